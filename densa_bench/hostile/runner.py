"""`densa bench hostile`: what hostile prompts cost everyone else.

A normal client sends short chat requests one after another; in the "hostile" phases, other
clients keep sending oversized prompts (4 MB of text each, several at once) that can never fit
the context. Phases alternate (quiet, hostile, quiet, ...) in one run, so the ratio of the
normal request's latency under attack to its quiet latency is measured side by side. Goal: the
oversized prompts are refused before they cost anything, so the ratio stays <= 1.2.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from dataclasses import asdict
from typing import Any

import httpx
import psutil

from densa.setup.args import EngineArgs
from densa_bench.common.report import BenchReport, Table
from densa_bench.common.stats import latency_stats
from densa_bench.hostile.settings import HostileSettings

NORMAL = [{"role": "user", "content": "What is the capital of France?"}]


def run_hostile_bench(settings: HostileSettings, engine_args: EngineArgs) -> BenchReport:
    from densa.serve.process import serve_engine_in_thread

    with serve_engine_in_thread(engine_args) as (base_url, client):
        samples = _run_phases(base_url, client.served.name, settings)
    return _report(settings, engine_args, samples)


def _run_phases(base_url: str, model: str, settings: HostileSettings) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    with httpx.Client(timeout=120) as client:
        _normal_request(client, base_url, model, settings)  # warm-up
        for repeat in range(settings.repeats):
            for phase in ("quiet", "hostile"):
                attack = _Attack(base_url, model, settings) if phase == "hostile" else None
                rss_before = psutil.Process().memory_info().rss
                for _ in range(settings.requests_per_phase):
                    latency = _normal_request(client, base_url, model, settings)
                    samples.append({"repeat": repeat, "phase": phase, "latency_s": latency})
                if attack is not None:
                    statuses = attack.stop()
                    samples[-1]["hostile_statuses"] = statuses
                samples[-1]["rss_growth_bytes"] = psutil.Process().memory_info().rss - rss_before
    return samples


def _normal_request(
    client: httpx.Client, base_url: str, model: str, settings: HostileSettings
) -> float:
    body = {"model": model, "messages": NORMAL, "max_tokens": settings.max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    response = client.post(base_url + "/v1/chat/completions", json=body)
    response.raise_for_status()
    return time.perf_counter() - start


class _Attack:
    """Processes (not threads: the attackers must not share the server's interpreter) that keep
    sending oversized prompts until stopped."""

    def __init__(self, base_url: str, model: str, settings: HostileSettings) -> None:
        context = multiprocessing.get_context("spawn")
        self._stopping = context.Event()
        self._results: Any = context.Queue()
        ready = context.Semaphore(0)
        args = (base_url + "/v1/chat/completions", model, settings.hostile_bytes)
        self._processes = [
            context.Process(target=_attack_loop, args=(*args, self._stopping, ready, self._results))
            for _ in range(settings.num_hostile)
        ]
        for process in self._processes:
            process.start()
        for _ in self._processes:  # every attacker has had an answer: the attack is under way
            if not ready.acquire(timeout=120):
                raise RuntimeError("a hostile client did not get going within 120 s")

    def stop(self) -> dict[int, int]:
        self._stopping.set()
        statuses: dict[int, int] = {}
        for _ in self._processes:
            for status, count in self._results.get(timeout=120).items():
                statuses[status] = statuses.get(status, 0) + count
        for process in self._processes:
            process.join(30)
        return statuses


def _attack_loop(
    url: str, model: str, num_bytes: int, stopping: Any, ready: Any, results: Any
) -> None:
    text = "lorem ipsum " * (num_bytes // 12)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}]}).encode()
    headers = {"content-type": "application/json"}
    statuses: dict[int, int] = {}
    with httpx.Client(timeout=120) as client:
        while True:
            status = client.post(url, content=body, headers=headers).status_code
            statuses[status] = statuses.get(status, 0) + 1
            if sum(statuses.values()) == 1:
                ready.release()
            if stopping.is_set():
                break
    results.put(statuses)


def _report(
    settings: HostileSettings, engine_args: EngineArgs, samples: list[dict[str, Any]]
) -> BenchReport:
    by_phase = {
        phase: [s["latency_s"] for s in samples if s["phase"] == phase]
        for phase in ("quiet", "hostile")
    }
    stats = {phase: latency_stats(values) for phase, values in by_phase.items()}
    ratio = stats["hostile"]["median"] / stats["quiet"]["median"]
    statuses: dict[str, int] = {}
    for sample in samples:
        for status, count in sample.get("hostile_statuses", {}).items():
            statuses[str(status)] = statuses.get(str(status), 0) + count
    growth = max(s.get("rss_growth_bytes", 0) for s in samples)
    summary = {"latency_s": stats, "median_ratio": ratio, "hostile_statuses": statuses,
               "max_rss_growth_bytes": growth}  # fmt: skip
    report = BenchReport(
        name="hostile",
        settings={**asdict(settings), "engine": asdict(engine_args)},
        samples=samples,
        summary=[summary],
        notes=HOSTILE_NOTES,
    )
    report.tables = [_latency_table(stats, ratio), _status_table(statuses, summary)]
    return report


HOSTILE_NOTES = [
    "The normal client runs sequentially (one request at a time) on loopback; latency is its "
    "end-to-end time for a 16-token greedy answer. Server and clients share this machine.",
    "Oversized prompts are refused with 400 context_length_exceeded before tokenization: the "
    "text is longer than the context could hold whatever the tokenizer made of it.",
    "RSS growth is the benchmark process (server included) over a phase.",
]


def _latency_table(stats: dict[str, dict[str, float]], ratio: float) -> Table:
    rows = [
        [phase, *(f"{stats[phase][q] * 1000:.0f}" for q in ("median", "p95", "max"))]
        for phase in ("quiet", "hostile")
    ]
    rows.append(["hostile / quiet (median)", f"{ratio:.2f}x", "", ""])
    return Table("Normal request latency (ms)", ["phase", "median", "p95", "max"], rows)


def _status_table(statuses: dict[str, int], summary: dict[str, Any]) -> Table:
    rows = [[f"HTTP {status}", str(count)] for status, count in sorted(statuses.items())]
    rows.append(["max RSS growth in a phase", f"{summary['max_rss_growth_bytes'] / 2**20:.0f} MiB"])
    return Table("Oversized prompts", ["", "count"], rows)
