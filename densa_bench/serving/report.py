"""Turn the waves of `densa bench serving` into raw samples, a summary, tables and plots."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from densa.utils.sizes import format_bytes
from densa_bench.common.report import BenchReport, LinePlot, Series, Table
from densa_bench.common.stats import format_spread, latency_stats, spread
from densa_bench.common.timing import Wave

NOTES = [
    "A wave submits `concurrency` requests at once and ends when all finish; output tok/s = "
    "output tokens of the wave / its wall time; total tok/s counts prompt tokens too.",
    "TTFT = submit -> first output token as the caller sees it; "
    "TPOT = (e2e - TTFT) / (tokens - 1); ITL = gaps between a request's consecutive tokens.",
    "HF TTFT comes from a timestamping streamer inside the same timed `generate` call (the end "
    "of prefill); static batching gives every request in the batch the same token times.",
    "Throughput cells: median (min..max) over repetitions; latency percentiles pool the requests "
    "of every repetition. The ratio is taken per repetition (adjacent, interleaved runs).",
    "Peak RSS is the whole process's high-water mark during the wave (reset per wave on Linux); "
    "both engines' weights are resident throughout, so compare the growth column across engines.",
]


def build_report(waves: list[Wave], settings: dict[str, Any]) -> BenchReport:
    groups = _group(waves)
    summary = [_summarize(key, group) for key, group in groups.items()]
    ratios = _ratios(groups)
    report = BenchReport(
        name="serving",
        settings=settings,
        samples=[_sample(w) for w in waves],
        summary=summary + ratios,
        notes=list(NOTES),
    )
    report.tables = [_main_table(summary), _kv_table(summary)]
    for name, title in RATIO_TITLES.items():
        if any(name in r for r in ratios):
            report.tables.append(_ratio_table(ratios, name, title))
    report.plots = _plots(summary)
    return report


def _group(waves: list[Wave]) -> dict[tuple[str, int], list[Wave]]:
    groups: dict[tuple[str, int], list[Wave]] = defaultdict(list)
    for wave in waves:
        groups[(wave.engine, wave.concurrency)].append(wave)
    return dict(groups)


# ---- numbers ---------------------------------------------------------------------------------
def _wave_rates(wave: Wave) -> dict[str, float]:
    num_prompt_tokens = wave.prompt_len * wave.concurrency
    return {
        "output_tok_s": wave.num_output_tokens / wave.wall_s,
        "total_tok_s": (num_prompt_tokens + wave.num_output_tokens) / wave.wall_s,
        "request_s": wave.concurrency / wave.wall_s,
    }


def _latencies(waves: list[Wave]) -> dict[str, list[float]]:
    """Every request's TTFT / TPOT / e2e and every inter-token gap, pooled over the waves."""
    requests = [r for w in waves for r in w.requests]
    return {
        "ttft_s": [r.ttft_s for r in requests],
        "tpot_s": [r.tpot_s for r in requests if r.tpot_s is not None],
        "e2e_s": [r.e2e_s for r in requests],
        "itl_s": [gap for r in requests for gap in r.itl_s],
    }


def _summarize(key: tuple[str, int], waves: list[Wave]) -> dict[str, Any]:
    engine, concurrency = key
    rates = [_wave_rates(w) for w in waves]
    row: dict[str, Any] = {"kind": "engine", "engine": engine, "concurrency": concurrency}
    row["repeats"] = len(waves)
    for name in ("output_tok_s", "total_tok_s", "request_s"):
        row[name] = spread([r[name] for r in rates])
    for name, values in _latencies(waves).items():
        row[name] = latency_stats(values) if values else None
    row["peak_rss_bytes"] = max(w.peak_rss_bytes for w in waves)
    row["rss_growth_bytes"] = max(w.peak_rss_bytes - w.start_rss_bytes for w in waves)
    # Engine counters (densa: KV pages in use, preemptions): the worst wave is what matters.
    row["engine_stats"] = {k: max(w.engine_stats[k] for w in waves) for k in waves[0].engine_stats}
    return row


# (engine, over engine) pairs whose output tok/s are compared, each ratio's name.
RATIOS = {
    ("densa", "hf"): "densa_over_hf_output_tok_s",
    ("densa-deterministic", "densa"): "deterministic_over_default_output_tok_s",
}
RATIO_TITLES = {
    "densa_over_hf_output_tok_s": "densa / HF",
    "deterministic_over_default_output_tok_s": "densa --deterministic / densa",
}


def _ratios(groups: dict[tuple[str, int], list[Wave]]) -> list[dict[str, Any]]:
    """densa / HF (and densa --deterministic / densa) output tok/s at each concurrency, paired by
    repetition."""
    rows = []
    for (engine, concurrency), waves in groups.items():
        for (top, bottom), name in RATIOS.items():
            other = groups.get((bottom, concurrency))
            if engine != top or not other:
                continue
            values = [a.output_tok_s / b.output_tok_s for a, b in zip(waves, other, strict=True)]
            rows.append({"kind": "ratio", "concurrency": concurrency, name: spread(values)})
    return rows


def _sample(wave: Wave) -> dict[str, Any]:
    """One wave's raw numbers: per-request latencies are kept, inter-token gaps summarized."""
    latencies = _latencies([wave])
    return {
        "engine": wave.engine,
        "concurrency": wave.concurrency,
        "repeat_idx": wave.repeat_idx,
        "wall_s": wave.wall_s,
        "num_prompt_tokens": wave.prompt_len * wave.concurrency,
        "num_output_tokens": wave.num_output_tokens,
        "num_cached_tokens": sum(r.num_cached_tokens for r in wave.requests),
        **_wave_rates(wave),
        "ttft_s": _rounded(latencies["ttft_s"]),
        "tpot_s": _rounded(latencies["tpot_s"]),
        "e2e_s": _rounded(latencies["e2e_s"]),
        "itl_s": latency_stats(latencies["itl_s"]) if latencies["itl_s"] else None,
        "peak_rss_bytes": wave.peak_rss_bytes,
        "start_rss_bytes": wave.start_rss_bytes,
        **wave.engine_stats,
    }


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 6) for v in values]  # microseconds are far below this harness's noise


# ---- tables and plots ------------------------------------------------------------------------
def _ms(stats: dict[str, float] | None, key: str) -> str:
    return "-" if stats is None else f"{stats[key] * 1000:.1f}"


def _main_table(summary: list[dict[str, Any]]) -> Table:
    columns = [
        "engine",
        "c",
        "output tok/s",
        "total tok/s",
        "req/s",
        "TTFT ms p50",
        "TTFT ms p95",
        "TPOT ms p50",
        "TPOT ms p95",
        "ITL ms p99",
        "peak RSS",
        "RSS growth",
    ]
    rows = [
        [
            row["engine"],
            str(row["concurrency"]),
            format_spread(row["output_tok_s"]),
            format_spread(row["total_tok_s"]),
            format_spread(row["request_s"], digits=2),
            _ms(row["ttft_s"], "median"),
            _ms(row["ttft_s"], "p95"),
            _ms(row["tpot_s"], "median"),
            _ms(row["tpot_s"], "p95"),
            _ms(row["itl_s"], "p99"),
            format_bytes(row["peak_rss_bytes"]),
            format_bytes(row["rss_growth_bytes"]),
        ]
        for row in sorted(summary, key=lambda r: (r["concurrency"], r["engine"]))
    ]
    return Table("Throughput and latency (median (min..max) over repetitions)", columns, rows)


def _kv_table(summary: list[dict[str, Any]]) -> Table:
    densa_rows = sorted(
        (r for r in summary if r["engine"] == "densa"), key=lambda r: r["concurrency"]
    )
    rows = []
    for row in densa_rows:
        stats = row["engine_stats"]
        pages = f"{stats['kv_pages_peak_used']} / {stats['kv_pages_total']}"
        rows.append([str(row["concurrency"]), pages, str(stats["preemptions"])])
    columns = ["c", "KV pages in use at peak / total", "preemptions"]
    return Table("densa KV cache (worst wave)", columns, rows)


def _ratio_table(ratios: list[dict[str, Any]], name: str, title: str) -> Table:
    rows = [
        [str(r["concurrency"]), format_spread(r[name], digits=2)]
        for r in sorted(ratios, key=lambda r: r["concurrency"])
        if name in r
    ]
    return Table(f"{title} output tokens/s (per-repetition ratio)", ["c", "ratio"], rows)


def _plots(summary: list[dict[str, Any]]) -> list[LinePlot]:
    by_engine: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in sorted(summary, key=lambda r: (r["engine"], r["concurrency"])):
        by_engine[row["engine"]].append(row)
    return [
        _concurrency_plot(
            by_engine, "output_tok_s", "Output tokens/s", "output tokens/s", bars=True
        ),
        _concurrency_plot(by_engine, "ttft_s", "Median TTFT", "TTFT (ms)", scale=1000),
        _concurrency_plot(by_engine, "tpot_s", "Median TPOT", "TPOT (ms)", scale=1000),
    ]


def _concurrency_plot(
    by_engine: dict[str, list[dict[str, Any]]],
    metric: str,
    title: str,
    y_label: str,
    scale: float = 1.0,
    bars: bool = False,
) -> LinePlot:
    """The median of `metric` against concurrency, one line per engine; min..max bars if asked."""
    series = []
    for engine, rows in by_engine.items():
        points = [r for r in rows if r[metric] is not None]  # e.g. no TPOT for 1-token outputs
        if not points:
            continue
        line = Series(
            engine, [r["concurrency"] for r in points], _values(points, metric, "median", scale)
        )
        if bars:
            line.y_min = _values(points, metric, "min", scale)
            line.y_max = _values(points, metric, "max", scale)
        series.append(line)
    return LinePlot(metric, f"{title} vs concurrency", "concurrency", y_label, series, log_x=True)


def _values(rows: list[dict[str, Any]], metric: str, stat: str, scale: float) -> list[float]:
    return [row[metric][stat] * scale for row in rows]
