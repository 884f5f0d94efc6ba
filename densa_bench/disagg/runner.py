"""`densa bench disagg`: co-located serving vs 1 prefill + 1 decode worker, on a mixed workload.

Workload: `num_decoders` short requests start at once and generate `decoder_output_len` tokens each;
while they decode, `num_long` long prompts arrive every `long_interval_s`. In one process a long
prefill shares every step with the decodes (chunked under the step's token budget), so the
decoders' inter-token latency (ITL) jumps whenever a long prompt is being ingested; split, the
prompt runs on the prefill worker and only its pages reach the decode worker.

Variants, measured interleaved (A B C A B C ...), each worker an engine core process of its own:
    colocated        one `--role both` engine, 2 threads (all the machine's cores)
    colocated-1-thread  the same with 1 thread
    split-same       prefill + decode engines, 1 thread and 1 core each, the same formats
    split-reference  prefill fp32 weights + BF16 KV, decode INT4 weights + FP8 KV (converted
                     at landing), 1 thread and 1 core each
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from densa.auth.placement import PLACEMENT_HEADER, sign_placement
from densa.auth.secret import ClusterSecret
from densa.engine.client import EngineClient
from densa.serve.disagg import PREFILL_HEADER, PlacementPolicy
from densa.serve.process import serve_engine_in_thread
from densa.setup.args import EngineArgs
from densa_bench.common.report import BenchReport
from densa_bench.common.stats import interleave, latency_stats
from densa_bench.disagg.report import build_report
from densa_bench.disagg.settings import DisaggSettings


@dataclass(frozen=True)
class Variant:
    name: str
    split: bool
    prefill: dict[str, Any] = field(default_factory=dict)  # EngineArgs overrides
    decode: dict[str, Any] = field(default_factory=dict)  # (colocated: the one engine's)
    threads: int = 2  # colocated: the engine's threads (split: always 1 per worker)


VARIANTS = (
    Variant("colocated", False),
    # The same, single-threaded: separates what the split changes from what a second OpenMP
    # thread costs on 2 cores shared with the HTTP fronts (spinning barriers, see CPU_NOTES.md).
    Variant("colocated-1-thread", False, threads=1),
    Variant("split-same", True),
    Variant(
        "split-reference",
        True,
        prefill={"kv_cache_dtype": "bfloat16"},
        decode={"weight_format": "int4", "kv_cache_dtype": "fp8_e4m3"},
    ),
)


@dataclass
class RequestResult:
    kind: str  # "decoder" | "long"
    submit_s: float = 0.0
    event_s: list[float] = field(default_factory=list)  # arrival of every streamed chunk
    num_tokens: int = 0
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.event_s[0] - self.submit_s if self.event_s else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.event_s, self.event_s[1:], strict=False)]


# ---- workers ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _engine(
    base: EngineArgs,
    overrides: dict[str, Any],
    threads: int,
    cpu: int | None,
    **app_options: Any,
) -> Iterator[tuple[str, EngineClient]]:
    """One worker; its engine process sees `threads` threads (and one core, if `cpu` is set)."""
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")}
    os.environ.update(OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads))
    args = dataclasses.replace(base, **overrides)
    try:
        with serve_engine_in_thread(args, **app_options) as (url, client):
            if cpu is not None:
                _pin(client.served.engine_pid, cpu)
            for key, value in saved.items():
                _restore(key, value)
            yield url, client
    finally:
        for key, value in saved.items():
            _restore(key, value)


def _restore(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _pin(pid: int, cpu: int) -> None:
    """Every thread of the engine process onto one core (sched_setaffinity is per thread)."""
    if cpu >= (os.cpu_count() or 1):
        return
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task.name), {cpu})


@contextlib.contextmanager
def _workers(variant: Variant, base: EngineArgs) -> Iterator[dict[str, Any]]:
    if not variant.split:
        with _engine(base, variant.decode, threads=variant.threads, cpu=None) as (url, client):
            yield {"url": url, "headers": dict, "decode": client, "model": client.served.name}
        return
    # As deployed: the pair shares a cluster secret (the KV link's MACs are part of what is
    # measured) and every request carries a placement signed as the router signs it.
    secret = ClusterSecret.generate()
    with tempfile.TemporaryDirectory(prefix="densa-bench-") as folder:
        secret_file = Path(folder) / "cluster-secret"
        secret.write(secret_file)
        pair = {"kv_transfer_timeout": 300.0, "cluster_secret_file": str(secret_file)}
        prefill_args = {"role": "prefill", **pair, **variant.prefill}
        decode_args = {"role": "decode", **pair, **variant.decode}
        with (
            _engine(base, prefill_args, threads=1, cpu=0) as (p_url, p_client),
            _engine(base, decode_args, threads=1, cpu=1, placement=PlacementPolicy(secret)) as (
                d_url, d_client,
            ),
        ):  # fmt: skip

            def headers() -> dict[str, str]:
                return {PREFILL_HEADER: p_url, PLACEMENT_HEADER: sign_placement(secret, p_url)}

            yield {"url": d_url, "headers": headers, "decode": d_client, "prefill": p_client,
                   "model": d_client.served.name}  # fmt: skip


# ---- one run ------------------------------------------------------------------------------------
def _prompts(
    settings: DisaggSettings, vocab: int, run_idx: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Fresh random prompts for every repetition: a repeat must not hit the prefix caches its
    predecessor filled (on either worker), or it would measure a different workload. (Variants
    have engines of their own, so within one repetition they share the prompts.)"""
    rng = random.Random(f"{settings.prompt_seed}-{run_idx}")

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    short = [ids(settings.decoder_prompt_len) for _ in range(settings.num_decoders)]
    return short, [ids(settings.long_prompt_len) for _ in range(settings.num_long)]


async def _one(
    http: httpx.AsyncClient,
    workers: dict[str, Any],
    prompt: list[int],
    max_tokens: int,
    result: RequestResult,
) -> None:
    body = {"model": workers["model"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    result.submit_s = time.perf_counter()
    url = workers["url"] + "/v1/completions"
    async with http.stream("POST", url, json=body, headers=workers["headers"]()) as response:
        if response.status_code != 200:
            result.error = f"http {response.status_code}: {(await response.aread())[:200]!r}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                result.error = str(event["error"])
                return
            if event.get("choices"):
                result.event_s.append(time.perf_counter())
                result.num_tokens += 1


async def _run_workload(
    workers: dict[str, Any], settings: DisaggSettings, short: list[list[int]], long: list[list[int]]
) -> tuple[list[RequestResult], float]:
    results: list[RequestResult] = []
    async with httpx.AsyncClient(timeout=600) as http:
        started = time.perf_counter()
        tasks = []
        for prompt in short:
            results.append(RequestResult("decoder"))
            tasks.append(
                asyncio.create_task(
                    _one(http, workers, prompt, settings.decoder_output_len, results[-1])
                )
            )
        for prompt in long:
            await asyncio.sleep(settings.long_interval_s)
            results.append(RequestResult("long"))
            tasks.append(
                asyncio.create_task(
                    _one(http, workers, prompt, settings.long_output_len, results[-1])
                )
            )
        await asyncio.gather(*tasks)
        return results, time.perf_counter() - started


def _sample(
    variant: Variant,
    repeat: int,
    results: list[RequestResult],
    wall_s: float,
    before: dict[str, float],
    after: dict[str, float],
    prefill_mac_ms: float = 0.0,
) -> dict[str, Any]:
    decoders = [r for r in results if r.kind == "decoder"]
    longs = [r for r in results if r.kind == "long"]
    itl = [gap for r in decoders for gap in r.itl_s]
    ttft = [t for r in results if (t := r.ttft_s) is not None]
    long_ttft = [t for r in longs if (t := r.ttft_s) is not None]  # none if they all failed
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    landed = delta.get("transfers_landed", 0.0)
    return {
        "variant": variant.name,
        "repeat": repeat,
        "errors": [r.error for r in results if r.error],
        "wall_s": wall_s,
        "output_tok_s": sum(r.num_tokens for r in results) / wall_s,
        "decode_itl_s": latency_stats(itl) if itl else {},
        "ttft_s": latency_stats(ttft) if ttft else {},
        "long_ttft_s": latency_stats(long_ttft) if long_ttft else {},
        "transfers": landed,
        "transfer_bytes_per_request": delta.get("bytes", 0.0) / landed if landed else 0.0,
        "transfer_ms_per_request": delta.get("transfer_ms", 0.0) / landed if landed else 0.0,
        "landing_ms_per_request": delta.get("landing_ms", 0.0) / landed if landed else 0.0,
        "prefill_ms_per_request": delta.get("prefill_ms", 0.0) / landed if landed else 0.0,
        # The link's authentication: P's MACs over the pages it sends + D's checks of them.
        "mac_ms_per_request": (delta.get("mac_ms", 0.0) + prefill_mac_ms) / landed
        if landed
        else 0.0,
    }


def _mac_ms(workers: dict[str, Any]) -> float:
    prefill = workers.get("prefill")
    return 0.0 if prefill is None else float(prefill.stats.disagg.get("mac_ms", 0.0))


def run_disagg(settings: DisaggSettings, base: EngineArgs) -> BenchReport:
    samples = []
    variants = {v.name: v for v in VARIANTS}
    with contextlib.ExitStack() as stack:
        workers = {v.name: stack.enter_context(_workers(v, base)) for v in VARIANTS}
        vocab = workers["colocated"]["decode"].served.vocab_size
        for warm_idx, w in enumerate(workers.values()):  # warm-up: one small untimed run each
            short, long = _prompts(settings, vocab, -1 - warm_idx)
            asyncio.run(
                _run_workload(
                    w, dataclasses.replace(settings, long_interval_s=0.0), short[:2], long[:1]
                )
            )
        for repeat, name in interleave(list(variants), settings.repeats):
            w = workers[name]
            short, long = _prompts(settings, vocab, repeat)  # the same for every variant
            before = dict(w["decode"].stats.disagg)
            p_before = _mac_ms(w)
            results, wall = asyncio.run(_run_workload(w, settings, short, long))
            time.sleep(0.6)  # a heartbeat brings the counters of the last transfers
            after = dict(w["decode"].stats.disagg)
            samples.append(
                _sample(variants[name], repeat, results, wall, before, after, _mac_ms(w) - p_before)
            )
    return build_report(settings, samples, base)
