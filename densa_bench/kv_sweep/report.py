"""The waves of `densa bench kv-sweep` as a summary, headline ratios, tables and plots."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from densa_bench.common.report import BenchReport, LinePlot, Series, Table
from densa_bench.common.stats import format_spread, latency_stats, median, spread
from densa_bench.common.timing import Wave

NOTES = [
    "One KV budget in bytes for every KV dtype, sized in BF16 requests (settings: "
    "benchmark.budget_requests); see the capacity table for what each dtype holds in it.",
    "A wave submits c requests at once and ends when all finish. output tok/s = output tokens / "
    "wave wall time (prefill included); decode tok/s = tokens sampled in decode-only steps / time "
    "in those steps, i.e. what the decode batch that fits buys.",
    "peak running = most requests running at once (admitted concurrently); preemptions = "
    "requests evicted for pages and recomputed; recomputed = prompt tokens computed beyond "
    "c x prompt_len because of preemptions. Counters show the worst wave.",
    "prefill share = time in steps that carry prefill tokens / time in all steps. Capacity cannot "
    "speed that part up: on a CPU, where prefill is compute-bound and slow, it caps the "
    "end-to-end gain that a larger decode batch gives.",
    "Cells: median (min..max) over repetitions; latency percentiles pool all repetitions' "
    "requests. Ratios are taken per repetition between adjacent interleaved waves.",
]


def build_report(waves: list[Wave], settings: dict[str, Any]) -> BenchReport:
    groups = _group(waves)
    summary = [_summarize(engine, c, group) for (engine, c), group in groups.items()]
    baseline = settings["benchmark"]["kv_dtypes"][0]
    headline = _headline(groups, summary, baseline)
    report = BenchReport(
        name="kv_sweep",
        settings=settings,
        samples=[_sample(w) for w in waves],
        summary=summary + headline,
        notes=list(NOTES),
    )
    report.tables = [
        _capacity_table(settings),
        _main_table(summary),
        _profile_table(summary),
        _headline_table(headline, baseline),
    ]
    report.plots = [
        _plot(summary, "output_tok_s", "Output tokens/s (wall, prefill included)", "tokens/s"),
        _plot(summary, "decode_tok_s", "Decode tokens/s (decode-only steps)", "tokens/s"),
        _plot(summary, "peak_running", "Requests admitted concurrently", "peak running"),
    ]
    return report


def _group(waves: list[Wave]) -> dict[tuple[str, int], list[Wave]]:
    groups: dict[tuple[str, int], list[Wave]] = defaultdict(list)
    for wave in waves:
        groups[(wave.engine, wave.concurrency)].append(wave)
    return dict(groups)


# ---- per wave and per point ------------------------------------------------------------------
def decode_tok_s(wave: Wave) -> float:
    stats = wave.engine_stats
    return stats["decode_tokens"] / (stats["decode_us"] / 1e6) if stats["decode_us"] else 0.0


def prefill_share(wave: Wave) -> float:
    stats = wave.engine_stats
    total = stats["prefill_us"] + stats["decode_us"]
    return stats["prefill_us"] / total if total else 0.0


def recomputed_tokens(wave: Wave) -> int:
    return wave.engine_stats["prefill_tokens"] - wave.concurrency * wave.prompt_len


def _summarize(engine: str, concurrency: int, waves: list[Wave]) -> dict[str, Any]:
    requests = [r for w in waves for r in w.requests]
    tpot = [r.tpot_s for r in requests if r.tpot_s is not None]
    worst = {k: max(w.engine_stats[k] for w in waves) for k in waves[0].engine_stats}
    return {
        "kind": "point",
        "engine": engine,
        "concurrency": concurrency,
        "repeats": len(waves),
        "output_tok_s": spread([w.output_tok_s for w in waves]),
        "decode_tok_s": spread([decode_tok_s(w) for w in waves]),
        "prefill_share": spread([prefill_share(w) for w in waves]),
        "peak_running": worst["peak_running"],
        "preemptions": worst["preemptions"],
        "recomputed_tokens": max(recomputed_tokens(w) for w in waves),
        "kv_pages_peak_used": worst["kv_pages_peak_used"],
        "kv_pages_total": worst["kv_pages_total"],
        "ttft_s": latency_stats([r.ttft_s for r in requests]),
        "tpot_s": latency_stats(tpot) if tpot else None,
        "e2e_s": latency_stats([r.e2e_s for r in requests]),
    }


def _headline(
    groups: dict[tuple[str, int], list[Wave]], summary: list[dict[str, Any]], baseline: str
) -> list[dict[str, Any]]:
    """Per non-baseline dtype: best throughput vs the baseline's best, and the c=1 slowdown."""
    rows = []
    engines = sorted({row["engine"] for row in summary} - {baseline})
    for engine in engines:
        row: dict[str, Any] = {"kind": "headline", "engine": engine, "baseline": baseline}
        for metric in ("output_tok_s", "decode_tok_s"):
            best, best_base = _best(summary, engine, metric), _best(summary, baseline, metric)
            row[f"best_{metric}"] = best
            row[f"best_{metric}_baseline"] = best_base
            row[f"best_{metric}_ratio"] = best["value"] / best_base["value"]
        lowest = min(c for e, c in groups if e == engine)
        pairs = list(zip(groups[(engine, lowest)], groups[(baseline, lowest)], strict=True))
        row["slowdown_concurrency"] = lowest
        row["slowdown_e2e"] = spread([_median_e2e(a) / _median_e2e(b) - 1 for a, b in pairs])
        row["slowdown_tpot"] = spread([_median_tpot(a) / _median_tpot(b) - 1 for a, b in pairs])
        rows.append(row)
    return rows


def _best(summary: list[dict[str, Any]], engine: str, metric: str) -> dict[str, Any]:
    points = [row for row in summary if row["engine"] == engine]
    top = max(points, key=lambda row: row[metric]["median"])
    return {"value": top[metric]["median"], "concurrency": top["concurrency"]}


def _median_e2e(wave: Wave) -> float:
    return median([r.e2e_s for r in wave.requests])


def _median_tpot(wave: Wave) -> float:
    return median([r.tpot_s for r in wave.requests if r.tpot_s is not None])


def _sample(wave: Wave) -> dict[str, Any]:
    return {
        "engine": wave.engine,
        "concurrency": wave.concurrency,
        "repeat_idx": wave.repeat_idx,
        "wall_s": wave.wall_s,
        "output_tok_s": wave.output_tok_s,
        "decode_tok_s": decode_tok_s(wave),
        "prefill_share": prefill_share(wave),
        "ttft_s": [round(r.ttft_s, 6) for r in wave.requests],
        "tpot_s": [round(r.tpot_s, 6) for r in wave.requests if r.tpot_s is not None],
        **wave.engine_stats,
    }


# ---- tables and plots ------------------------------------------------------------------------
def _ms(stats: dict[str, float] | None, key: str) -> str:
    return "-" if stats is None else f"{stats[key] * 1000:.0f}"


def _ordered(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(summary, key=lambda row: (row["concurrency"], row["engine"]))


def _capacity_table(settings: dict[str, Any]) -> Table:
    rows = [
        [
            engine,
            info["kv_scales"],
            str(info["bytes_per_token"]),
            str(info["kv_pages"]),
            str(info["resident_tokens"]),
            str(info["requests_that_fit"]),
        ]
        for engine, info in settings["capacity"].items()
    ]
    columns = ["KV dtype", "scales", "bytes/token", "pages", "resident tokens", "requests fit"]
    return Table("What the fixed KV budget holds", columns, rows)


def _main_table(summary: list[dict[str, Any]]) -> Table:
    columns = [
        "c",
        "KV dtype",
        "output tok/s",
        "decode tok/s",
        "peak running",
        "preemptions",
        "TTFT ms p50",
        "TTFT ms p95",
        "TPOT ms p50",
        "TPOT ms p95",
    ]
    rows = [
        [
            str(row["concurrency"]),
            row["engine"],
            format_spread(row["output_tok_s"]),
            format_spread(row["decode_tok_s"]),
            str(row["peak_running"]),
            str(row["preemptions"]),
            _ms(row["ttft_s"], "median"),
            _ms(row["ttft_s"], "p95"),
            _ms(row["tpot_s"], "median"),
            _ms(row["tpot_s"], "p95"),
        ]
        for row in _ordered(summary)
    ]
    return Table("Throughput, admission and latency per concurrency", columns, rows)


def _profile_table(summary: list[dict[str, Any]]) -> Table:
    columns = ["c", "KV dtype", "prefill share of step time", "recomputed tokens", "KV pages peak"]
    rows = [
        [
            str(row["concurrency"]),
            row["engine"],
            format_spread({k: 100 * v for k, v in row["prefill_share"].items()}) + " %",
            str(row["recomputed_tokens"]),
            f"{row['kv_pages_peak_used']} / {row['kv_pages_total']}",
        ]
        for row in _ordered(summary)
    ]
    return Table("Profile: where the time goes (worst wave for counters)", columns, rows)


def _headline_table(headline: list[dict[str, Any]], baseline: str) -> Table:
    rows = []
    for row in headline:
        engine = row["engine"]
        for metric in ("output_tok_s", "decode_tok_s"):
            best, base = row[f"best_{metric}"], row[f"best_{metric}_baseline"]
            rows.append(
                [
                    f"best {metric.replace('_', ' ')}",
                    engine,
                    f"{best['value']:.1f} (c={best['concurrency']})",
                    f"{base['value']:.1f} (c={base['concurrency']})",
                    f"{row[f'best_{metric}_ratio']:.2f}x",
                ]
            )
        for metric in ("e2e", "tpot"):
            stats = {k: 100 * v for k, v in row[f"slowdown_{metric}"].items()}
            label = f"per-request slowdown (median {metric}, c={row['slowdown_concurrency']})"
            rows.append([label, engine, "", "", format_spread(stats) + " %"])
    columns = ["", "KV dtype", "value", baseline, "ratio / change"]
    return Table(f"Headline: each KV dtype vs {baseline} under the same KV budget", columns, rows)


def _plot(summary: list[dict[str, Any]], metric: str, title: str, y_label: str) -> LinePlot:
    by_engine: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in _ordered(summary):
        by_engine[row["engine"]].append(row)
    series = []
    for engine, rows in by_engine.items():
        x = [row["concurrency"] for row in rows]
        if isinstance(rows[0][metric], dict):
            series.append(
                Series(
                    engine,
                    x,
                    [row[metric]["median"] for row in rows],
                    [row[metric]["min"] for row in rows],
                    [row[metric]["max"] for row in rows],
                )
            )
        else:
            series.append(Series(engine, x, [float(row[metric]) for row in rows]))
    return LinePlot(metric, f"{title} vs concurrency", "concurrency", y_label, series, log_x=True)
