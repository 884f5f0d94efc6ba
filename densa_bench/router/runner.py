"""`densa bench router`: routing policies side by side over the same three workers.

Three real workers (`densa serve`, one compute thread each) on this machine; for each policy a
fresh `densa router` process in front of them. The workload is multi-tenant multi-turn chat:
tenants of unequal size (the default 6, 2 and 1 sessions), each with its own system prompt
shared by all its sessions; each session sends `turns` turns (the whole history each time, with
x-session-affinity), each user message carrying a short document (`user_words` words), the
sessions starting `stagger_s` apart. Every run salts the system prompts
with its run id, so no run is helped by a cache another run left on the workers. Policies are
interleaved (A B C D, A B C D, ...).

Measured per run: prefix hit rate (cached / prompt tokens, from usage), TTFT (request sent ->
first content chunk) p50 / p95, output tok/s (output tokens / run wall time), and the router's
own time per request (x-densa-router-ms: body read, tokenize, score). Separately, the latency the
router adds end to end: tiny requests sent directly to a worker and through the router,
alternating.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from densa.utils.logging import get_logger
from densa_bench.common.local_workers import (
    REPO,
    WorkerProcess,
    WorkerSettings,
    free_port,
    running_workers,
)
from densa_bench.common.report import BenchReport, LinePlot, Series, Table
from densa_bench.common.stats import interleave, latency_stats, median, spread
from densa_bench.router.settings import RouterBenchSettings

logger = get_logger(__name__)

POLICIES = ("round-robin", "least-load", "prefix", "densa")
SINGLE_SIGNAL = ("least-load", "prefix")
GOAL_HIT_RATIO = 2.0  # densa's hit rate vs round-robin's
GOAL_ROUTER_MS = 2.0  # p50 of the router's own time per request
_TOPICS = ("billing", "rockets", "shipping", "returns", "warranty", "fuel", "orbits", "launch")


# ---- one policy run -----------------------------------------------------------------------------
@contextlib.contextmanager
def router_process(urls: list[str], policy: str, log: Path) -> Iterator[str]:
    port = free_port()
    workers = [arg for url in urls for arg in ("--worker", url)]
    # --debug-headers: the benchmark reads which worker served each request and the router's
    # own time (x-densa-worker, x-densa-router-ms), which clients do not get by default.
    command = [sys.executable, "-m", "densa.cli", "--log-level", "WARNING", "router",
               "--port", str(port), "--policy", policy, "--debug-headers", *workers]  # fmt: skip
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_router(base, process, log)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_router(base: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the router exited: {log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            health = httpx.get(base + "/health", timeout=1)
            if health.status_code == 200 and health.json().get("model"):
                return
        time.sleep(0.1)
    raise RuntimeError("the router did not become ready in 60 s")


def system_prompt(tenant: int, run_id: str, words: int) -> str:
    topic = _TOPICS[tenant % len(_TOPICS)]
    body = " ".join(
        f"{topic}-rule-{i} applies to every {topic} question." for i in range(words // 6)
    )
    return f"Run {run_id}. You are tenant {tenant}'s assistant for {topic}. {body}"


def user_message(tenant: int, session: int, turn: int, run_id: str, words: int) -> str:
    """A question about a short document of `words` words, different for every turn."""
    topic = _TOPICS[(session + turn) % len(_TOPICS)]
    document = " ".join(f"{_TOPICS[(i * 7 + turn + session) % len(_TOPICS)]}{i % 13}"
                        for i in range(words))  # fmt: skip
    return f"[{run_id} t{tenant} s{session} turn {turn}] About {topic}: {document}. Summarize."


def _stream_turn(
    client: httpx.Client, base: str, key: str, session: str, messages: list[dict[str, str]],
    max_tokens: int,
) -> dict[str, Any]:  # fmt: skip
    body = {"model": "densa", "messages": messages, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    headers = {"authorization": f"Bearer {key}", "x-session-affinity": session}
    sent = time.perf_counter()
    ttft, text, usage = None, [], {}
    with client.stream("POST", base + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        worker, router_ms = r.headers["x-densa-worker"], float(r.headers["x-densa-router-ms"])
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - sent
                    text.append(choice["delta"]["content"])
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": ttft, "text": "".join(text), "worker": worker, "router_ms": router_ms,
            "prompt_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "cached_tokens": details.get("cached_tokens", 0)}  # fmt: skip


def run_workload(base: str, settings: RouterBenchSettings, run_id: str) -> dict[str, Any]:
    """Every session of every tenant, staggered; returns the run's per-request samples."""
    sessions = [(t, s) for t, n in enumerate(settings.tenant_sessions) for s in range(n)]
    order = sorted(sessions, key=lambda ts: (ts[1], ts[0]))  # interleave tenants' sessions
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def converse(idx: int, tenant: int, session: int) -> None:
        time.sleep(idx * settings.stagger_s)
        system = system_prompt(tenant, run_id, settings.system_words)
        messages = [{"role": "system", "content": system}]
        with httpx.Client(timeout=300) as client:
            for turn in range(settings.turns):
                question = user_message(tenant, session, turn, run_id, settings.user_words)
                messages.append({"role": "user", "content": question})
                sample = _stream_turn(client, base, f"tenant-{tenant}-key",
                                      f"{run_id}-t{tenant}-s{session}", messages,
                                      settings.max_tokens)  # fmt: skip
                messages.append({"role": "assistant", "content": sample.pop("text")})
                with lock:
                    results.append({**sample, "tenant": tenant, "session": session, "turn": turn})

    started = time.perf_counter()
    threads = [threading.Thread(target=converse, args=(i, t, s)) for i, (t, s) in enumerate(order)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return {"wall_s": wall, "requests": results}


def summarize_run(run: dict[str, Any]) -> dict[str, Any]:
    requests = run["requests"]
    prompt = sum(r["prompt_tokens"] for r in requests)
    ttfts = [r["ttft_s"] for r in requests if r["ttft_s"] is not None]
    stats = latency_stats(ttfts)
    per_worker: dict[str, int] = {}
    for r in requests:
        per_worker[r["worker"]] = per_worker.get(r["worker"], 0) + 1
    return {
        "hit_rate": sum(r["cached_tokens"] for r in requests) / prompt if prompt else 0.0,
        "ttft_p50_s": stats["median"],
        "ttft_p95_s": stats["p95"],
        "output_tok_s": sum(r["output_tokens"] for r in requests) / run["wall_s"],
        "router_ms_p50": median([r["router_ms"] for r in requests]),
        "num_requests": len(requests),
        "requests_per_worker": sorted(per_worker.values()),
    }


# ---- the router's added latency -----------------------------------------------------------------
def added_latency(base: str, worker_url: str, probes: int) -> dict[str, Any]:
    """Tiny non-streamed requests, alternately direct and routed: e2e medians and their gap."""
    body = {"model": "densa", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    direct: list[float] = []
    routed: list[float] = []
    with httpx.Client(timeout=60) as client:
        for i in range(probes * 2):
            url = (worker_url if i % 2 == 0 else base) + "/v1/chat/completions"
            started = time.perf_counter()
            client.post(url, json=body).raise_for_status()
            (direct if i % 2 == 0 else routed).append(time.perf_counter() - started)
    return {"direct_ms": median(direct) * 1000, "routed_ms": median(routed) * 1000,
            "added_ms_p50": (median(routed) - median(direct)) * 1000}  # fmt: skip


# ---- the benchmark ------------------------------------------------------------------------------
def run_router_bench(settings: RouterBenchSettings, work_dir: Path) -> BenchReport:
    work_dir.mkdir(parents=True, exist_ok=True)
    worker_settings = WorkerSettings(settings.model, "densa", settings.kv_cache_memory,
                                     settings.max_model_len)  # fmt: skip
    samples: list[dict[str, Any]] = []
    with running_workers(worker_settings, 3, work_dir) as workers:
        urls = [w.url for w in workers]
        _warm_up(workers)
        with router_process(urls, "densa", work_dir / "router-latency.log") as base:
            latency = added_latency(base, urls[0], settings.latency_probes)
        for repeat_idx, policy in interleave(POLICIES, settings.repeats):
            run_id = f"{policy}-{repeat_idx}"
            logger.info("run %s", run_id)
            with router_process(urls, policy, work_dir / f"router-{run_id}.log") as base:
                run = run_workload(base, settings, run_id)
            samples.append({"policy": policy, "repeat_idx": repeat_idx, **summarize_run(run),
                            "requests": run["requests"]})  # fmt: skip
    return build_report(settings, samples, latency)


def _warm_up(workers: list[WorkerProcess]) -> None:
    body = {"model": "densa", "messages": [{"role": "user", "content": "warm up"}],
            "max_tokens": 4}  # fmt: skip
    for worker in workers:
        httpx.post(worker.url + "/v1/chat/completions", json=body, timeout=120).raise_for_status()


def build_report(
    settings: RouterBenchSettings, samples: list[dict[str, Any]], latency: dict[str, Any]
) -> BenchReport:
    summary: list[dict[str, Any]] = []
    for policy in POLICIES:
        runs = [s for s in samples if s["policy"] == policy]
        summary.append({"policy": policy, **{k: spread([r[k] for r in runs]) for k in
                        ("hit_rate", "ttft_p50_s", "ttft_p95_s", "output_tok_s",
                         "router_ms_p50")}})  # fmt: skip
    by = {row["policy"]: row for row in summary}
    report = BenchReport(
        name="router",
        settings={**asdict(settings), "policies": list(POLICIES), "latency": latency},
        samples=samples,
        summary=summary,
        notes=_verdicts(by, latency) + NOTES,
    )
    report.tables = [_table(summary), _latency_table(latency)]
    report.plots = [_turn_plot(samples)]
    return report


def _verdicts(by: dict[str, dict[str, Any]], latency: dict[str, Any]) -> list[str]:
    hit = by["densa"]["hit_rate"]["median"]
    rr_hit = by["round-robin"]["hit_rate"]["median"]
    ratio = hit / rr_hit if rr_hit else float("inf")
    p95 = by["densa"]["ttft_p95_s"]["median"]
    worse = [p for p in SINGLE_SIGNAL if by[p]["ttft_p95_s"]["median"] <= p95]
    router_ms = by["densa"]["router_ms_p50"]["median"]

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    return [
        f"Hit rate: densa {hit:.1%} vs round-robin {rr_hit:.1%} = {ratio:.2f}x "
        f"(goal >= {GOAL_HIT_RATIO:g}x: {met(ratio >= GOAL_HIT_RATIO)}).",
        f"TTFT p95: densa {p95 * 1000:.0f} ms vs "
        + ", ".join(f"{p} {by[p]['ttft_p95_s']['median'] * 1000:.0f} ms" for p in SINGLE_SIGNAL)
        + f" (goal: lower than every single-signal policy: {met(not worse)}).",
        f"Router's own time per request, p50: {router_ms:.2f} ms; end to end, a routed tiny "
        f"request took {latency['added_ms_p50']:.2f} ms longer than a direct one (median of "
        f"{latency['routed_ms']:.1f} vs {latency['direct_ms']:.1f} ms) "
        f"(goal <= {GOAL_ROUTER_MS:g} ms p50: {met(latency['added_ms_p50'] <= GOAL_ROUTER_MS)}).",
    ]


NOTES = [
    "Hit rate = cached prompt tokens / prompt tokens over every request of a run (the workers' "
    "usage.prompt_tokens_details.cached_tokens). TTFT = request sent -> first content chunk, "
    "at the client. Output tok/s = output tokens of the run / its wall time (sessions start "
    "`stagger_s` apart, so it includes idle time at the start and end of a run).",
    "Policies: round-robin (each request to the next worker), least-load (queue depth only), "
    "prefix (prefix overlap only; ties to the least-routed worker), densa (the five-signal "
    "score with its default weights; docs/routing.md).",
    "Three workers with one compute thread each share this machine's cores with the router and "
    "the client threads, so absolute times are slower than on dedicated machines; compare the "
    "policies with each other, within this run.",
]


def _table(summary: list[dict[str, Any]]) -> Table:
    def cell(
        stats: dict[str, float], scale: float = 1.0, digits: int = 0, pct: bool = False
    ) -> str:
        if pct:
            return f"{stats['median']:.1%} ({stats['min']:.1%}..{stats['max']:.1%})"
        m, lo, hi = (stats[k] * scale for k in ("median", "min", "max"))
        return f"{m:.{digits}f} ({lo:.{digits}f}..{hi:.{digits}f})"

    rows = [[r["policy"], cell(r["hit_rate"], pct=True), cell(r["ttft_p50_s"], 1000),
             cell(r["ttft_p95_s"], 1000), cell(r["output_tok_s"], digits=1),
             cell(r["router_ms_p50"], digits=2)] for r in summary]  # fmt: skip
    columns = ["policy", "prefix hit rate", "TTFT p50 (ms)", "TTFT p95 (ms)", "output tok/s",
               "router ms p50"]  # fmt: skip
    return Table("Policies side by side (median over runs, min..max)", columns, rows)


def _latency_table(latency: dict[str, Any]) -> Table:
    rows = [[f"{latency['direct_ms']:.2f}", f"{latency['routed_ms']:.2f}",
             f"{latency['added_ms_p50']:.2f}"]]  # fmt: skip
    return Table("Router added latency (tiny requests, 1 output token, medians)",
                 ["direct (ms)", "through the router (ms)", "added (ms)"], rows)  # fmt: skip


def _turn_plot(samples: list[dict[str, Any]]) -> LinePlot:
    series = []
    for policy in POLICIES:
        turns: dict[int, list[float]] = {}
        for s in samples:
            if s["policy"] == policy:
                for r in s["requests"]:
                    if r["ttft_s"] is not None:
                        turns.setdefault(r["turn"], []).append(r["ttft_s"] * 1000)
        xs = sorted(turns)
        series.append(Series(policy, [float(x + 1) for x in xs], [median(turns[x]) for x in xs]))
    return LinePlot("ttft_by_turn", "TTFT by chat turn (median over sessions and runs)", "turn",
                    "TTFT (ms)", series)  # fmt: skip
