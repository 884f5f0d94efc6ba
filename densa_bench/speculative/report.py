"""The report of `densa bench speculative`: per workload and variant, throughput, TPOT and
acceptance at each concurrency; the issue's goals as ratios."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from densa_bench.common.report import BenchReport, LinePlot, Series, Table
from densa_bench.common.stats import latency_stats, median, spread
from densa_bench.speculative.runner import SpecWave, draft_counters, tokens_per_event

NOTES = [
    "Every variant is its own server process; one OpenAI-client load generator streams every "
    "request (/v1/completions, the prompt rendered with the model's chat template, greedy, "
    "exactly output_len tokens, EOS ignored). Waves run interleaved across variants.",
    "output tok/s = output tokens of the wave / its wall time; TPOT = (e2e - TTFT) / (tokens - "
    "1), median over the requests of every repetition.",
    "tok/event = output tokens per streamed event: densa streams each step's tokens as one "
    "event, so for densa it is 1 + the proposals accepted per step. llama-server streams token "
    "by token (1.00). 'accepted' = accepted / proposed tokens from each server's own counters "
    "(densa's /metrics over the wave; llama-server's draft_n / draft_n_accepted timings).",
    "The machine is shared: each raw sample records the 1-minute load average before and after "
    "its wave.",
]


@dataclass(frozen=True)
class Goal:
    """A ratio the issue asks for, between two variants on one workload and concurrency."""

    label: str
    workload: str
    concurrency: int  # 0: the largest measured
    variant: str  # the speculating variant
    versus: str
    metric: str  # "tpot_s" (ratio versus / variant: higher is better) or "output_tok_s"
    target: float


GOALS = [
    *(
        Goal(f"c=1 code-edit TPOT: {v} vs off", "code-edit", 1, v, "densa off", "tpot_s", 2.0)
        for v in ("densa draft", "densa ngram")
    ),
    *(
        Goal(
            f"c=1 code-edit TPOT: {v} vs llama.cpp",
            "code-edit",
            1,
            v,
            "llama.cpp draft",
            "tpot_s",
            1.3,
        )
        for v in ("densa draft", "densa ngram")
    ),
    *(
        Goal(f"largest c {w} tok/s: {v} vs off", w, 0, v, "densa off", "output_tok_s", 0.97)
        for w in ("code-edit", "chat")
        for v in ("densa draft", "densa ngram")
    ),
]


def build_report(
    waves: list[SpecWave], variants: dict[str, dict[str, Any]], settings: dict[str, Any]
) -> BenchReport:
    groups: dict[tuple[str, str, int], list[SpecWave]] = defaultdict(list)
    for wave in waves:
        groups[(wave.workload, wave.peer_wave.wave.engine, wave.peer_wave.wave.concurrency)].append(
            wave
        )
    summary = [_summarize(key, group) for key, group in sorted(groups.items())]
    goals = _goals(summary)
    report = BenchReport(
        name="speculative",
        settings={**settings, "variants": variants},
        samples=[_sample(w) for w in waves],
        summary=summary + goals,
        notes=list(NOTES),
    )
    workloads = sorted({row["workload"] for row in summary})
    report.tables = [_workload_table(summary, w) for w in workloads]
    if goals:
        report.tables.append(_goal_table(goals))
    report.plots = [_plot(summary, w, m) for w in workloads for m in ("output_tok_s", "tpot_s")]
    return report


def _summarize(key: tuple[str, str, int], waves: list[SpecWave]) -> dict[str, Any]:
    workload, variant, concurrency = key
    requests = [r for w in waves for r in w.peer_wave.wave.requests]
    tpot = [r.tpot_s for r in requests if r.tpot_s is not None]
    # llama-server's draft counters per request, or densa's own over the wave (/metrics)
    counters = [c for w in waves if (c := draft_counters(w.peer_wave)) is not None]
    counters += [w.spec_counters for w in waves if w.spec_counters is not None]
    drafted = sum(c[0] for c in counters)
    return {
        "kind": "variant",
        "workload": workload,
        "variant": variant,
        "concurrency": concurrency,
        "repeats": len(waves),
        "output_tok_s": spread([w.peer_wave.wave.output_tok_s for w in waves]),
        "tpot_s": latency_stats(tpot) if tpot else None,
        "ttft_s": latency_stats([r.ttft_s for r in requests]),
        "tokens_per_event": median([tokens_per_event(w.peer_wave) for w in waves]),
        "draft_acceptance": sum(c[1] for c in counters) / drafted if drafted else None,
    }


def _goals(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = {(r["workload"], r["variant"], r["concurrency"]): r for r in summary}
    out = []
    for goal in GOALS:
        levels = [r["concurrency"] for r in summary if r["workload"] == goal.workload]
        concurrency = goal.concurrency or max(levels, default=0)
        mine = rows.get((goal.workload, goal.variant, concurrency))
        theirs = rows.get((goal.workload, goal.versus, concurrency))
        if mine is None or theirs is None or mine[goal.metric] is None or not theirs[goal.metric]:
            continue
        a, b = mine[goal.metric]["median"], theirs[goal.metric]["median"]
        ratio = b / a if goal.metric == "tpot_s" else a / b
        out.append(
            {
                "kind": "goal",
                "goal": goal.label,
                "concurrency": concurrency,
                "ratio": ratio,
                "target": goal.target,
                "met": ratio >= goal.target,
            }
        )
    return out


def _sample(spec_wave: SpecWave) -> dict[str, Any]:
    peer_wave = spec_wave.peer_wave
    wave = peer_wave.wave
    return {
        "workload": spec_wave.workload,
        "variant": wave.engine,
        "concurrency": wave.concurrency,
        "repeat_idx": wave.repeat_idx,
        "wall_s": wave.wall_s,
        "output_tok_s": wave.output_tok_s,
        "prompt_tokens": [r.prompt_tokens for r in peer_wave.requests],
        "events_per_request": [len(r.event_s) for r in peer_wave.requests],
        "ttft_s": [round(r.ttft_s, 6) for r in wave.requests],
        "tpot_s": [round(r.tpot_s, 6) for r in wave.requests if r.tpot_s is not None],
        "draft_counters": draft_counters(peer_wave),
        "densa_spec_counters": spec_wave.spec_counters,
        "failed_attempts": peer_wave.failed_attempts,
        "load_average_1m": list(peer_wave.load_average),
    }


def _workload_table(summary: list[dict[str, Any]], workload: str) -> Table:
    rows = []
    for row in summary:
        if row["workload"] != workload:
            continue
        tpot = row["tpot_s"]
        acceptance = row["draft_acceptance"]
        rows.append(
            [
                row["variant"],
                str(row["concurrency"]),
                f"{row['output_tok_s']['median']:.1f}",
                "-" if tpot is None else f"{tpot['median'] * 1000:.1f}",
                f"{row['ttft_s']['median'] * 1000:.0f}",
                f"{row['tokens_per_event']:.2f}",
                "-" if acceptance is None else f"{acceptance:.0%}",
            ]
        )
    columns = ["variant", "c", "output tok/s", "TPOT p50 ms", "TTFT p50 ms", "tok/event",
               "accepted"]  # fmt: skip
    return Table(f"{workload}", columns, rows)


def _goal_table(goals: list[dict[str, Any]]) -> Table:
    rows = [
        [
            g["goal"],
            str(g["concurrency"]),
            f"{g['ratio']:.2f}x",
            f">= {g['target']}x",
            "met" if g["met"] else "not met",
        ]
        for g in goals
    ]
    return Table("Goals (issue 26)", ["goal", "c", "measured", "target", ""], rows)


def _plot(summary: list[dict[str, Any]], workload: str, metric: str) -> LinePlot:
    by_variant: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in summary:
        if row["workload"] == workload and row[metric] is not None:
            by_variant[row["variant"]].append(row)
    key = "median"
    series = [
        Series(
            variant,
            [float(r["concurrency"]) for r in rows],
            [r[metric][key] * (1000 if metric == "tpot_s" else 1) for r in rows],
        )
        for variant, rows in by_variant.items()
    ]
    label = "output tok/s" if metric == "output_tok_s" else "TPOT p50 (ms)"
    slug = workload.replace("-", "_")
    return LinePlot(f"{slug}_{metric}", f"{workload}: {label}", "concurrency", label, series, True)
