"""The report of `densa bench agent`: the reference deployment's signals per engine, the goals."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from densa_bench.agent.runner import AgentRun, TurnRecord
from densa_bench.common.report import BenchReport, LinePlot, Series, Table
from densa_bench.common.stats import latency_stats

NOTES = [
    "Each engine and replay is a fresh server: no replay is helped by another's prefix cache. "
    "Replays interleave (every engine once, then again), so drift of the shared machine falls "
    "on every engine alike.",
    "TTFT = submit -> the first streamed delta (text or tool call) of a turn; its percentiles "
    "pool every turn of every session and replay. Output tok/s = completion tokens of a replay "
    "/ its wall time (all sessions at once), median over replays.",
    "Valid = one or more calls to a defined tool whose arguments are a JSON object with the "
    "required keys of the declared types. Timeout = a turn that failed on the client's "
    "timeout (no byte for --turn-timeout seconds) or took longer than it.",
    "Prefix hits = prompt tokens the server reported cached / prompt tokens (densa: "
    "usage.prompt_tokens_details.cached_tokens; llama-server: timings.cache_n). Ceiling: what "
    "the previous turn's prompt could give (its prompt is the next one's prefix).",
    "Consistency = share of (session, turn) whose calls (and text) in replay 2 equal replay 1's, "
    "turn by turn; every request is the same in both (the traces append scripted calls, not the "
    "model's).",
]


def _pooled(runs: Sequence[AgentRun]) -> list[TurnRecord]:
    return [t for run in runs for t in run.turns]


def summarize(engine: str, runs: Sequence[AgentRun]) -> dict[str, Any]:
    turns = _pooled(runs)
    ttft = [t.ttft_s for t in turns if t.ttft_s is not None]
    prompt = sum(t.prompt_tokens for t in turns)
    by_run = [{(t.session, t.turn): t for t in run.turns} for run in runs]
    ceiling = sum(run[(s, n - 1)].prompt_tokens for run in by_run for (s, n) in run if n > 0) / max(
        1, prompt
    )
    consistency = None
    if len(by_run) > 1:
        keys = sorted(by_run[0])
        same = [
            by_run[0][k].signature() == by_run[1][k].signature() for k in keys if k in by_run[1]
        ]
        consistency = sum(same) / max(1, len(same))
    return {
        "engine": engine,
        "replays": len(runs),
        "turns": len(turns),
        "valid_share": sum(t.valid for t in turns) / max(1, len(turns)),
        "timeouts": sum(t.timed_out for t in turns),
        "errors": sum(t.error is not None for t in turns),
        "ttft_s": latency_stats(ttft) if ttft else None,
        "output_tok_s": statistics.median(
            sum(t.completion_tokens for t in run.turns) / run.wall_s for run in runs
        ),
        "prefix_hit_share": sum(t.cached_tokens for t in turns) / max(1, prompt),
        "prefix_hit_ceiling": ceiling,
        "consistency": consistency,
        "wall_s": [round(run.wall_s, 1) for run in runs],
        "load_average_1m": [run.load_average for run in runs],
    }


def build_report(runs: Sequence[AgentRun], settings: dict[str, Any]) -> BenchReport:
    by_engine: dict[str, list[AgentRun]] = defaultdict(list)
    for run in runs:
        by_engine[run.engine].append(run)
    summary = [summarize(engine, rs) for engine, rs in by_engine.items()]
    goals = _goals(summary)
    report = BenchReport(
        name="agent",
        settings=settings,
        samples=[_sample(run) for run in runs],
        summary=summary + goals,
        notes=list(NOTES),
    )
    report.tables = [_table(summary)]
    if goals:
        report.tables.append(_goal_table(goals))
    report.plots = [_ttft_plot(by_engine)]
    return report


def _goals(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 38's goals for every densa engine: turn TTFT p95 <= 0.5x llama.cpp's, no timeouts,
    >= 99% valid calls."""
    llama = next((r for r in summary if r["engine"] == "llama.cpp"), None)
    out = []
    for row in summary:
        if not row["engine"].startswith("densa"):
            continue
        if llama is not None and row["ttft_s"] and llama["ttft_s"]:
            ratio = row["ttft_s"]["p95"] / llama["ttft_s"]["p95"]
            out.append(_goal("turn TTFT p95 vs llama.cpp", row["engine"], f"{ratio:.2f}x",
                             "<= 0.5x", ratio <= 0.5))  # fmt: skip
        out.append(_goal("timeouts", row["engine"], str(row["timeouts"]), "0",
                         row["timeouts"] == 0))  # fmt: skip
        out.append(_goal("valid tool calls", row["engine"], f"{100 * row['valid_share']:.1f}%",
                         ">= 99%", row["valid_share"] >= 0.99))  # fmt: skip
    return out


def _goal(label: str, engine: str, value: str, target: str, met: bool) -> dict[str, Any]:
    return {"kind": "goal", "goal": label, "engine": engine, "value": value, "target": target,
            "met": met}  # fmt: skip


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _table(summary: list[dict[str, Any]]) -> Table:
    columns = ["engine", "turns", "valid calls", "timeouts", "TTFT p50 s", "TTFT p95 s",
               "output tok/s", "prefix hits (ceiling)", "consistency", "wall s"]  # fmt: skip
    rows = []
    for r in summary:
        ttft = r["ttft_s"]
        rows.append([
            r["engine"], str(r["turns"]), _pct(r["valid_share"]), str(r["timeouts"]),
            "-" if ttft is None else f"{ttft['median']:.2f}",
            "-" if ttft is None else f"{ttft['p95']:.2f}",
            f"{r['output_tok_s']:.1f}",
            f"{_pct(r['prefix_hit_share'])} ({_pct(r['prefix_hit_ceiling'])})",
            _pct(r["consistency"]), " / ".join(f"{w:.0f}" for w in r["wall_s"]),
        ])  # fmt: skip
    return Table("Agent sessions, per engine (all replays pooled)", columns, rows)


def _goal_table(goals: list[dict[str, Any]]) -> Table:
    rows = [[g["goal"], g["engine"], g["value"], g["target"], "met" if g["met"] else "not met"]
            for g in goals]  # fmt: skip
    return Table("Goals (issue 38)", ["goal", "engine", "value", "target", ""], rows)


def _ttft_plot(by_engine: dict[str, list[AgentRun]]) -> LinePlot:
    series = []
    for engine, runs in by_engine.items():
        per_turn: dict[int, list[float]] = defaultdict(list)
        for t in _pooled(runs):
            if t.ttft_s is not None:
                per_turn[t.turn].append(t.ttft_s)
        turns = sorted(per_turn)
        series.append(Series(engine, [float(n + 1) for n in turns],
                             [statistics.median(per_turn[n]) for n in turns],
                             [min(per_turn[n]) for n in turns],
                             [max(per_turn[n]) for n in turns]))  # fmt: skip
    return LinePlot("ttft_by_turn", "Turn TTFT by turn (median, min..max over sessions)",
                    "turn", "TTFT (s)", series)  # fmt: skip


def _sample(run: AgentRun) -> dict[str, Any]:
    return {
        "engine": run.engine,
        "replay": run.replay,
        "wall_s": run.wall_s,
        "load_average_1m": list(run.load_average),
        "turns": [vars(t) for t in run.turns],
    }
