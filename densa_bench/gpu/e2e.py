"""The end-to-end half of the GPU check: a random-weight ~1.1B Llama served by densa's engine on
the GPU, in waves of c = 1, 8, 16, 32, 64 requests, for three comparisons:

    kv          BF16 vs FP8 KV pages, one KV budget in bytes, sized so BF16 holds ~36 requests
                (it queues or preempts at 64) while FP8 holds ~70
    weights     BF16 vs INT4 weights (g128 round-to-nearest at load), a roomy KV budget
    integrity   page-tag checks on vs off, a roomy KV budget

Five engines share the process and run interleaved (for each c and repeat: every engine once),
so a ratio is taken between runs made side by side. A wave submits c requests at once (random
prompt ids, no shared prefix, EOS ignored) and ends when all finish. Every engine step is timed
and classed decode-only or carrying prefill: decode tok/s is what a larger decode batch buys.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from densa.engine.hooks import StepRecord
from densa.engine.llm_engine import LLMEngine
from densa.engine.metrics import snapshot
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs


@dataclass(frozen=True)
class E2ESettings:
    device: str = "cuda"
    dtype: str = "bfloat16"
    concurrency: tuple[int, ...] = (1, 8, 16, 32, 64)
    prompt_len: int = 512
    output_len: int = 128
    repeats: int = 2
    page_size: int = 16
    max_num_batched_tokens: int = 2048
    budget_requests: float = 36.0  # the tight KV budget, in whole BF16 requests
    wave_seconds: float = 4.0  # a wave's cost when deciding whether the budget allows it
    engine_seconds: float = 30.0  # an engine's build, graph capture and warm-up, likewise

    @property
    def request_len(self) -> int:
        return self.prompt_len + self.output_len

    @classmethod
    def tiny(cls) -> E2ESettings:
        return cls(
            device="cpu", dtype="float32", concurrency=(1, 2), prompt_len=8, output_len=3,
            repeats=1, page_size=4, max_num_batched_tokens=64, budget_requests=2.5,
            wave_seconds=1.0, engine_seconds=5.0,
        )  # fmt: skip


@dataclass(frozen=True)
class Variant:
    """One engine: a name, the comparisons it takes part in, and its EngineArgs overrides."""

    name: str
    experiments: tuple[str, ...]
    overrides: dict[str, Any]


def baseline_kv_dtype(settings: E2ESettings) -> str:
    """BF16 pages on a GPU; the compute dtype in a CPU dry run (bf16 is slow there)."""
    return "bfloat16" if settings.device != "cpu" else settings.dtype


def variants(settings: E2ESettings, kv_bytes_per_token: int) -> list[Variant]:
    """kv_bytes_per_token: of the baseline KV dtype, which sizes both budgets."""
    tight = int(settings.budget_requests * settings.request_len * kv_bytes_per_token)
    roomy = 2 * max(settings.concurrency) * settings.request_len * kv_bytes_per_token
    kv16 = baseline_kv_dtype(settings)
    return [
        Variant("base", ("weights", "integrity"), {"kv_cache_memory": f"{roomy}B"}),
        Variant("int4", ("weights",), {"kv_cache_memory": f"{roomy}B", "weight_format": "int4"}),
        Variant(
            "integrity_off", ("integrity",), {"kv_cache_memory": f"{roomy}B", "kv_integrity": False}
        ),
        Variant("kv_bf16", ("kv",), {"kv_cache_memory": f"{tight}B", "kv_cache_dtype": kv16}),
        Variant("kv_fp8", ("kv",), {"kv_cache_memory": f"{tight}B", "kv_cache_dtype": "fp8_e4m3"}),
    ]


def engine_args(model_dir: Path, settings: E2ESettings, variant: Variant) -> EngineArgs:
    return EngineArgs(
        model=str(model_dir),
        dtype=settings.dtype,
        device=settings.device,
        max_model_len=settings.request_len + settings.page_size,
        page_size=settings.page_size,
        max_num_seqs=max(settings.concurrency),
        max_num_batched_tokens=settings.max_num_batched_tokens,
        enable_prefix_caching=False,
        **variant.overrides,
    )


class StepRecorder:
    """Observes an engine's steps: time and shape of each (the GPU syncs on sampling)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: list[tuple[float, int, bool]] = []  # seconds, rows, decode-only
        engine.observers.add(self._record)

    def _record(self, record: StepRecord) -> None:
        rows = len(record.step.scheduled)
        decode_only = all(item.num_tokens == 1 for item in record.step.scheduled)
        self.steps.append((record.seconds, rows, decode_only and rows > 0))


def run_wave(
    engine: LLMEngine, recorder: StepRecorder, prompts: list[list[int]], output_len: int
) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    recorder.steps.clear()
    preempted_before = snapshot(engine).num_preemptions
    start = time.perf_counter()
    first: dict[str, float] = {}
    finished: dict[str, float] = {}
    for tokens in prompts:
        engine.add_request(tokens, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter() - start
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                finished[out.request_id] = now
                if out.error:
                    raise RuntimeError(f"{out.request_id} failed: {out.error}")
    wall = time.perf_counter() - start
    decode = [(s, rows) for s, rows, only in recorder.steps if only]
    decode_s = sum(s for s, _ in decode)
    tpots = [(finished[r] - first[r]) / (output_len - 1) for r in finished if output_len > 1]
    return {
        "wall_s": wall,
        "output_tok_s": len(prompts) * output_len / wall,
        "decode_tok_s": sum(rows for _, rows in decode) / decode_s if decode_s else None,
        "decode_step_ms": 1e3 * decode_s / len(decode) if decode else None,
        "max_decode_batch": max((rows for _, rows in decode), default=0),
        "prefill_share": 1 - decode_s / sum(s for s, _, _ in recorder.steps),
        "ttft_ms_p50": 1e3 * statistics.median(first.values()),
        "tpot_ms_mean": 1e3 * statistics.fmean(tpots) if tpots else None,
        "preemptions": snapshot(engine).num_preemptions - preempted_before,
    }


def make_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab_size) for _ in range(length - 1)] for _ in range(count)]


def run_sweep(
    model_dir: Path,
    settings: E2ESettings,
    vocab_size: int,
    kv_bytes_per_token: int,
    time_left: Callable[[], float],
    log: Callable[[str], None] = print,
) -> tuple[dict[str, Any], list[str]]:
    """Build every engine, warm each up, then the interleaved waves while time lasts."""
    engines: dict[str, tuple[LLMEngine, StepRecorder]] = {}
    info: dict[str, Any] = {"settings": dataclasses.asdict(settings), "engines": {}, "runs": []}
    skipped: list[str] = []
    chosen = variants(settings, kv_bytes_per_token)
    for variant in chosen:
        if time_left() < settings.engine_seconds:
            skipped.append(f"e2e: engine {variant.name} (time budget)")
            continue
        start = time.perf_counter()
        engine = LLMEngine.from_args(engine_args(model_dir, settings, variant))
        recorder = StepRecorder(engine)
        for count in (1, max(settings.concurrency)):  # warm-up: compiles for both ends
            run_wave(engine, recorder, make_prompts(count, settings.prompt_len, vocab_size, -1), 2)
        engines[variant.name] = (engine, recorder)
        info["engines"][variant.name] = {
            "experiments": list(variant.experiments),
            "overrides": variant.overrides,
            "num_pages": engine.config.cache.num_pages,
            "fits_requests": engine.config.cache.num_pages
            // -(-settings.request_len // settings.page_size),
            "build_and_warmup_s": time.perf_counter() - start,
            "cuda_graphs": engine.runner.decode_graphs is not None,
        }
        log(f"engine {variant.name}: {info['engines'][variant.name]}")
    for concurrency in settings.concurrency:
        for repeat in range(settings.repeats):
            prompts = make_prompts(concurrency, settings.prompt_len, vocab_size, repeat)
            for variant in chosen:
                if variant.name not in engines:
                    continue
                if time_left() < settings.wave_seconds:
                    skipped.append(f"e2e: {variant.name} c={concurrency} repeat {repeat}")
                    continue
                engine, recorder = engines[variant.name]
                result = run_wave(engine, recorder, prompts, settings.output_len)
                info["runs"].append(
                    {"variant": variant.name, "experiments": list(variant.experiments),
                     "concurrency": concurrency, "repeat": repeat, **result}
                )  # fmt: skip
                log(f"{variant.name} c={concurrency} r{repeat}: {result['output_tok_s']:.0f} tok/s")
    return info, skipped
