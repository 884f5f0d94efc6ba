"""The report of `densa bench peers`: throughput and latency per peer, ratios, the goals."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from densa.utils.sizes import format_bytes
from densa_bench.common.report import BenchReport, LinePlot, Series, Table
from densa_bench.common.stats import format_spread, latency_stats, median, spread
from densa_bench.common.timing import Wave
from densa_bench.peers.runner import PeerWave

NOTES = [
    "Every peer is its own server process; one OpenAI-client load generator streams every "
    "request (/v1/completions, text prompts, greedy, exactly output_len tokens).",
    "A wave submits `c` requests at once and ends when all finish; output tok/s = output tokens "
    "/ wall time. TTFT = submit -> first streamed token; TPOT = (e2e - TTFT) / (tokens - 1); "
    "ITL = gaps between a request's streamed tokens. Latency percentiles pool the requests of "
    "every repetition; throughput cells are median (min..max) over repetitions.",
    "decode tok/s at c=1 = 1 / median TPOT; prefill tok/s at c=1 = prompt tokens / median TTFT "
    "(so it includes one HTTP round trip and the first sampling step).",
    "Peak RSS: the sum of the server processes' high-water marks during the wave (densa: HTTP "
    "front + engine process; reset before each wave).",
    "Ratios are taken per repetition between adjacent, interleaved waves, then summarized.",
    "With several prompt lengths, each length is its own rows (`prompt`: the length asked for; "
    "`prompt tokens`, what the server counted). At long prompts TTFT is the prefill of the "
    "whole prompt and TPOT is decode attending to all of it.",
    "The machine is shared: each raw sample records the 1-minute load average before and after "
    "its wave; a load above the core count means other work competed for the cores.",
]


@dataclass(frozen=True)
class Goal:
    """A ratio the issue asks for: metric of a densa peer over the same metric of a peer."""

    label: str
    metric: str  # a key of the summary rows ("output_tok_s", "decode_tok_s", "peak_rss_bytes")
    concurrency: int  # 0: the largest concurrency both peers ran
    versus: str  # the peer's engine
    target: float
    at_most: bool = False  # met when the ratio is <= target (memory), not >= (speed)
    # The prompt length it is stated at; 0: the run's shortest, if short (< 4096 tokens).
    prompt_len: int = 0

    def met(self, ratio: float) -> bool:
        return ratio <= self.target if self.at_most else ratio >= self.target


GOALS = [  # issue 15 (the bundled model) and issue 21 (the real 1.5B: prefill and memory too)
    Goal("c=1 decode tok/s vs llama.cpp", "decode_tok_s", 1, "llama.cpp", 1.1),
    Goal("c=32 output tok/s vs llama.cpp", "output_tok_s", 32, "llama.cpp", 2.0),
    Goal("prefill tok/s (c=1) vs llama.cpp", "prefill_tok_s", 1, "llama.cpp", 1.0),
    Goal("peak RSS (largest c) vs llama.cpp", "peak_rss_bytes", 0, "llama.cpp", 1.2, at_most=True),
    Goal("c=32 output tok/s vs transformers", "output_tok_s", 32, "transformers", 3.0),
    Goal("prefill tok/s (c=1) vs transformers", "prefill_tok_s", 1, "transformers", 1.5),
    # Issue 38: speed at length.
    Goal("prefill at 16k (c=1) vs llama.cpp", "prefill_tok_s", 1, "llama.cpp", 1.5, False, 16384),
    Goal("prefill at 32k (c=1) vs llama.cpp", "prefill_tok_s", 1, "llama.cpp", 1.5, False, 32768),
    Goal("decode at 32k (c=1) vs llama.cpp", "decode_tok_s", 1, "llama.cpp", 1.2, False, 32768),
]
SHORT_PROMPT = 4096  # goals stated without a length apply to runs of shorter prompts


def build_report(
    waves: list[PeerWave], peers: dict[str, dict[str, Any]], settings: dict[str, Any]
) -> BenchReport:
    groups = _group(waves)
    summary = [_summarize(key, group) for key, group in groups.items()]
    ratios = _ratios(groups, peers)
    goals = _goals(summary, peers)
    report = BenchReport(
        name="peers",
        settings={**settings, "peers": peers},
        samples=[_sample(w) for w in waves],
        summary=summary + ratios + goals,
        notes=list(NOTES),
    )
    report.tables = [_peer_table(peers), _main_table(summary), _ratio_table(ratios)]
    if goals:
        report.tables.append(_goal_table(goals))
    report.plots = _plots(summary)
    return report


Key = tuple[str, int, int]  # (peer, prompt length asked for, concurrency)


def _group(waves: list[PeerWave]) -> dict[Key, list[Wave]]:
    groups: dict[Key, list[Wave]] = defaultdict(list)
    for w in waves:
        groups[(w.wave.engine, w.target_len or w.wave.prompt_len, w.wave.concurrency)].append(
            w.wave
        )
    return dict(groups)


# ---- numbers ---------------------------------------------------------------------------------
def _summarize(key: Key, waves: list[Wave]) -> dict[str, Any]:
    peer, length, concurrency = key
    requests = [r for w in waves for r in w.requests]
    ttft = [r.ttft_s for r in requests]
    tpot = [r.tpot_s for r in requests if r.tpot_s is not None]
    itl = [gap for r in requests for gap in r.itl_s]
    prompt_len = median([float(w.prompt_len) for w in waves])
    return {
        "kind": "peer",
        "peer": peer,
        "prompt_len": length,
        "concurrency": concurrency,
        "repeats": len(waves),
        "prompt_tokens": prompt_len,
        "output_tok_s": spread([w.output_tok_s for w in waves]),
        "ttft_s": latency_stats(ttft),
        "tpot_s": latency_stats(tpot) if tpot else None,
        "itl_s": latency_stats(itl) if itl else None,
        "decode_tok_s": 1.0 / median(tpot) if tpot else None,
        "prefill_tok_s": prompt_len / median(ttft),
        "peak_rss_bytes": max(w.peak_rss_bytes for w in waves),
    }


def _ratios(
    groups: dict[Key, list[Wave]], peers: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each densa peer's output tok/s over every other engine's, paired by repetition."""
    rows = []
    for (name, length, concurrency), waves in sorted(groups.items(), key=lambda kv: kv[0][1:]):
        if peers[name]["engine"] != "densa":
            continue
        for other, info in peers.items():
            other_waves = groups.get((other, length, concurrency))
            if info["engine"] == "densa" or not other_waves:
                continue
            by_repeat = {w.repeat_idx: w for w in other_waves}
            values = [
                w.output_tok_s / by_repeat[w.repeat_idx].output_tok_s
                for w in waves
                if w.repeat_idx in by_repeat
            ]
            rows.append(
                {
                    "kind": "ratio",
                    "peer": name,
                    "versus": other,
                    "prompt_len": length,
                    "concurrency": concurrency,
                    "output_tok_s_ratio": spread(values),
                }
            )
    return rows


def _goals(summary: list[dict[str, Any]], peers: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = {(r["peer"], r.get("prompt_len", 0), r["concurrency"]): r for r in summary}
    largest = max((r["concurrency"] for r in summary), default=0)
    shortest = min((r.get("prompt_len", 0) for r in summary), default=0)
    out = []
    for goal in GOALS:
        length = goal.prompt_len or (shortest if shortest < SHORT_PROMPT else -1)
        others = [n for n, info in peers.items() if info["engine"] == goal.versus]
        for name, info in peers.items():
            if info["engine"] != "densa":
                continue
            for other in others:
                concurrency = goal.concurrency or largest
                mine = rows.get((name, length, concurrency))
                theirs = rows.get((other, length, concurrency))
                if mine is None or theirs is None:
                    continue
                ratio = _metric(mine, goal.metric) / _metric(theirs, goal.metric)
                out.append(
                    {
                        "kind": "goal",
                        "goal": goal.label,
                        "peer": name,
                        "versus": other,
                        "ratio": ratio,
                        "target": goal.target,
                        "at_most": goal.at_most,
                        "met": goal.met(ratio),
                    }
                )
    return out


def _metric(row: dict[str, Any], metric: str) -> float:
    value = row[metric]
    return float(value["median"] if isinstance(value, dict) else value)


def _sample(peer_wave: PeerWave) -> dict[str, Any]:
    wave = peer_wave.wave
    return {
        "peer": wave.engine,
        "prompt_len": peer_wave.target_len or wave.prompt_len,
        "concurrency": wave.concurrency,
        "repeat_idx": wave.repeat_idx,
        "wall_s": wave.wall_s,
        "output_tok_s": wave.output_tok_s,
        "prompt_tokens": [r.prompt_tokens for r in peer_wave.requests],
        "events_per_request": [len(r.event_s) for r in peer_wave.requests],
        "ttft_s": [round(r.ttft_s, 6) for r in wave.requests],
        "tpot_s": [round(r.tpot_s, 6) for r in wave.requests if r.tpot_s is not None],
        "peak_rss_bytes": wave.peak_rss_bytes,
        "start_rss_bytes": wave.start_rss_bytes,
        "failed_attempts": peer_wave.failed_attempts,
        "load_average_1m": list(peer_wave.load_average),
    }


# ---- tables and plots ------------------------------------------------------------------------
def _ms(stats: dict[str, float] | None, key: str) -> str:
    return "-" if stats is None else f"{stats[key] * 1000:.1f}"


def _peer_table(peers: dict[str, dict[str, Any]]) -> Table:
    keys = sorted({k for info in peers.values() for k in info["formats"]})
    rows = [
        [name, info["engine"], *(info["formats"].get(k, "-") for k in keys)]
        for name, info in peers.items()
    ]
    return Table("Peers and their formats", ["peer", "engine", *keys], rows)


def _main_table(summary: list[dict[str, Any]]) -> Table:
    columns = [
        "peer", "prompt", "c", "output tok/s", "TTFT ms p50", "TTFT p95", "TPOT ms p50",
        "TPOT p95", "ITL ms p50", "ITL p95", "prefill tok/s", "peak RSS",
    ]  # fmt: skip
    rows = [
        [
            row["peer"],
            str(row["prompt_len"]),
            str(row["concurrency"]),
            format_spread(row["output_tok_s"]),
            _ms(row["ttft_s"], "median"),
            _ms(row["ttft_s"], "p95"),
            _ms(row["tpot_s"], "median"),
            _ms(row["tpot_s"], "p95"),
            _ms(row["itl_s"], "median"),
            _ms(row["itl_s"], "p95"),
            f"{row['prefill_tok_s']:.1f}",
            format_bytes(row["peak_rss_bytes"]),
        ]
        for row in sorted(summary, key=lambda r: (r["prompt_len"], r["concurrency"], r["peer"]))
    ]
    return Table("Throughput and latency (median (min..max) over repetitions)", columns, rows)


def _ratio_table(ratios: list[dict[str, Any]]) -> Table:
    rows = [
        [r["peer"], r["versus"], str(r["prompt_len"]), str(r["concurrency"]),
         format_spread(r["output_tok_s_ratio"], 2)]
        for r in ratios
    ]  # fmt: skip
    columns = ["densa peer", "versus", "prompt", "c", "output tok/s ratio"]
    return Table("Output tokens/s ratios (per repetition)", columns, rows)


def _goal_table(goals: list[dict[str, Any]]) -> Table:
    rows = [
        [g["goal"], g["peer"], g["versus"], f"{g['ratio']:.2f}x",
         f"{'<=' if g.get('at_most') else '>='} {g['target']}x", "met" if g["met"] else "not met"]
        for g in goals
    ]  # fmt: skip
    return Table(
        "Goals (issues 15, 21, 38)", ["goal", "densa peer", "versus", "ratio", "target", ""], rows
    )


def _plots(summary: list[dict[str, Any]]) -> list[LinePlot]:
    if len({r["prompt_len"] for r in summary}) > 1:
        return _length_plots(summary)
    by_peer: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in sorted(summary, key=lambda r: (r["peer"], r["concurrency"])):
        by_peer[row["peer"]].append(row)
    output = [
        Series(
            peer,
            [r["concurrency"] for r in rows],
            [r["output_tok_s"]["median"] for r in rows],
            [r["output_tok_s"]["min"] for r in rows],
            [r["output_tok_s"]["max"] for r in rows],
        )
        for peer, rows in by_peer.items()
    ]
    plots = [LinePlot("output_tok_s", "Output tokens/s vs concurrency", "concurrency",
                      "output tokens/s", output, log_x=True)]  # fmt: skip
    for metric, title in (("tpot_s", "Median TPOT"), ("ttft_s", "Median TTFT")):
        series = [
            Series(
                peer,
                [r["concurrency"] for r in rows if r[metric]],
                [r[metric]["median"] * 1000 for r in rows if r[metric]],
            )
            for peer, rows in by_peer.items()
        ]
        plots.append(LinePlot(metric, f"{title} vs concurrency", "concurrency",
                              title.split()[-1] + " (ms)", series, log_x=True))  # fmt: skip
    return plots


def _length_plots(summary: list[dict[str, Any]]) -> list[LinePlot]:
    """Several prompt lengths: TTFT, prefill tok/s and TPOT against the length, at the lowest
    concurrency each peer ran."""
    lowest = min(r["concurrency"] for r in summary)
    by_peer: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in sorted(summary, key=lambda r: (r["peer"], r["prompt_len"])):
        if row["concurrency"] == lowest:
            by_peer[row["peer"]].append(row)
    metrics = [
        ("ttft_by_length", "TTFT (s)", lambda r: r["ttft_s"]["median"]),
        ("prefill_by_length", "prefill tokens/s", lambda r: r["prefill_tok_s"]),
        ("tpot_by_length", "TPOT (ms)", lambda r: r["tpot_s"]["median"] * 1000),
    ]
    plots = []
    for name, y_label, value in metrics:
        series = [
            Series(peer, [r["prompt_len"] for r in rows], [value(r) for r in rows])
            for peer, rows in by_peer.items()
        ]
        title = f"{y_label.split(' (')[0]} vs prompt length (c={lowest})"
        plots.append(LinePlot(name, title, "prompt tokens", y_label, series, log_x=True))
    return plots
