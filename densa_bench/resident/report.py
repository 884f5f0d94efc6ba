"""The report of `densa bench resident`: resident sessions per engine and KV type."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from densa.utils.sizes import format_bytes
from densa_bench.common.report import BenchReport, Table

NOTES = [
    "Sessions are admitted one after another (prompt, then 8 generated tokens); then each "
    "returns with the same prompt, newest first. A return whose prompt the server reports "
    ">= 90% cached was resident (densa: usage.prompt_tokens_details.cached_tokens; "
    "llama-server: timings.cache_n).",
    "densa: one server per KV format with its pages in the budget (--kv-cache-memory), finished "
    "sessions' pages kept as prefix cache (least recently used out first, tail pages first). "
    "llama-server: one slot per session (-np N, -c N x session length, -no-kvu: each slot "
    "keeps its last prompt's KV), N the most whose KV buffer as the server logs it at start-up "
    "fits the budget, flash attention on (-fa on: needed for a quantized V cache), "
    "--cache-ram 0 (no host-memory prompt cache beside the KV buffer).",
    "`computed`: the budget over a session's bytes (densa: whole pages, docs/kv-cache.md; "
    "llama.cpp: the slots found by starting the server).",
]


def build_report(results: Sequence[Any], settings: dict[str, Any]) -> BenchReport:
    rows = [
        [
            r.engine,
            r.kv_type,
            str(r.sessions_sent),
            str(r.resident),
            str(r.computed),
            format_bytes(r.kv_buffer_bytes) if r.kv_buffer_bytes else "-",
            f"{r.wall_s:.0f}",
        ]
        for r in results
    ]
    budget = format_bytes(settings["kv_budget_bytes"])
    title = f"Sessions of {settings['session_len']} tokens resident in {budget} of KV"
    table = Table(
        title,
        ["engine", "KV type", "sent", "resident (measured)", "computed", "KV buffer", "wall s"],
        rows,
    )
    return BenchReport(
        name="resident",
        settings=settings,
        samples=[asdict(r) for r in results],
        summary=[
            {
                "engine": r.engine,
                "kv_type": r.kv_type,
                "resident": r.resident,
                "computed": r.computed,
            }
            for r in results
        ],
        tables=[table],
        notes=list(NOTES),
    )
