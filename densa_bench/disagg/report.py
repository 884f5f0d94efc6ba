"""Tables, plot and notes of `densa bench disagg` (the measuring is in bench/disagg.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from densa.setup.args import EngineArgs
from densa_bench.common.report import BenchReport, LinePlot, Series, Table
from densa_bench.common.stats import spread

_PERCENTILES = (("median", 50), ("p95", 95), ("p99", 99))


def _spread_of(samples: list[dict[str, Any]], pick: Any) -> dict[str, float]:
    values = [v for s in samples if (v := pick(s)) is not None]
    return spread(values) if values else {"median": 0.0, "min": 0.0, "max": 0.0}


def _cell(stats: dict[str, float], scale: float = 1.0, digits: int = 1) -> str:
    m, lo, hi = (stats[k] * scale for k in ("median", "min", "max"))
    return f"{m:.{digits}f} ({lo:.{digits}f}..{hi:.{digits}f})"


def summarize(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    names = list(dict.fromkeys(s["variant"] for s in samples))
    summary = []
    for name in names:
        runs = [s for s in samples if s["variant"] == name]
        row: dict[str, Any] = {"variant": name, "num_runs": len(runs)}
        for key, field in (("decode_itl_s", "median"), ("decode_itl_s", "p99")):
            row[f"{key}_{field}"] = _spread_of(runs, lambda s, k=key, f=field: s[k].get(f))
        row["decode_itl_s_p95"] = _spread_of(runs, lambda s: s["decode_itl_s"].get("p95"))
        row["ttft_s_median"] = _spread_of(runs, lambda s: s["ttft_s"].get("median"))
        row["ttft_s_p95"] = _spread_of(runs, lambda s: s["ttft_s"].get("p95"))
        row["long_ttft_s_median"] = _spread_of(runs, lambda s: s["long_ttft_s"].get("median"))
        for key in ("output_tok_s", "transfer_bytes_per_request", "transfer_ms_per_request",
                    "landing_ms_per_request", "prefill_ms_per_request",
                    "mac_ms_per_request"):  # fmt: skip
            row[key] = _spread_of(runs, lambda s, k=key: s.get(k, 0.0))
        row["mac_share_of_transfer"] = _spread_of(runs, _mac_share)
        row["errors"] = sum(len(s["errors"]) for s in runs)
        summary.append(row)
    return summary


def _mac_share(sample: dict[str, Any]) -> float:
    """The KV link's authentication (MACs computed by P, checked by D) as a share of the
    transfer time (PrefillRequest sent -> pages landed)."""
    transfer = sample.get("transfer_ms_per_request", 0.0)
    return sample.get("mac_ms_per_request", 0.0) / transfer if transfer else 0.0


def build_report(settings: Any, samples: list[dict[str, Any]], base: EngineArgs) -> BenchReport:
    summary = summarize(samples)
    settings_dict = dataclasses.asdict(settings)
    settings_dict["model"] = base.model or "bundled SmolLM2-135M-Instruct"
    settings_dict["kv_cache_memory"] = base.kv_cache_memory
    return BenchReport(
        name="disagg",
        settings=settings_dict,
        samples=samples,
        summary=summary,
        tables=[_latency_table(summary), _transfer_table(summary)],
        plots=[_itl_plot(summary)],
        notes=NOTES,
    )


def _latency_table(summary: list[dict[str, Any]]) -> Table:
    return Table(
        "Latency and throughput (median of runs, min..max in brackets)",
        [
            "variant",
            "decode ITL p50 ms",
            "decode ITL p99 ms",
            "TTFT p50 ms",
            "TTFT p95 ms",
            "long-prompt TTFT p50 ms",
            "output tok/s",
            "errors",
        ],
        [
            [
                r["variant"],
                _cell(r["decode_itl_s_median"], 1e3),
                _cell(r["decode_itl_s_p99"], 1e3),
                _cell(r["ttft_s_median"], 1e3, 0),
                _cell(r["ttft_s_p95"], 1e3, 0),
                _cell(r["long_ttft_s_median"], 1e3, 0),
                _cell(r["output_tok_s"]),
                str(r["errors"]),
            ]
            for r in summary
        ],
    )


def _transfer_table(summary: list[dict[str, Any]]) -> Table:
    return Table(
        "KV handoff per request (split variants; measured on the decode worker)",
        [
            "variant",
            "KiB moved",
            "transfer ms (asked -> landed)",
            "landing + conversion ms",
            "prefill worker ms (queue + compute + pack)",
            "authentication ms (MACs, both sides)",
            "authentication / transfer",
        ],
        [
            [
                r["variant"],
                _cell(r["transfer_bytes_per_request"], 1 / 1024, 0),
                _cell(r["transfer_ms_per_request"]),
                _cell(r["landing_ms_per_request"], 1.0, 2),
                _cell(r["prefill_ms_per_request"]),
                _cell(r["mac_ms_per_request"], 1.0, 3),
                _cell(r["mac_share_of_transfer"], 100.0, 2) + " %",
            ]
            for r in summary
            if r["variant"].startswith("split")
        ],
    )


def _itl_plot(summary: list[dict[str, Any]]) -> LinePlot:
    return LinePlot(
        "decode_itl",
        "Decode inter-token latency while long prompts arrive",
        "percentile",
        "ITL (ms)",
        [
            Series(
                r["variant"],
                [float(q) for _, q in _PERCENTILES],
                [r[f"decode_itl_s_{k}"]["median"] * 1e3 for k, _ in _PERCENTILES],
                [r[f"decode_itl_s_{k}"]["min"] * 1e3 for k, _ in _PERCENTILES],
                [r[f"decode_itl_s_{k}"]["max"] * 1e3 for k, _ in _PERCENTILES],
            )
            for r in summary
        ],
    )


NOTES = [
    "colocated: one engine process with 2 threads on both cores; split: a prefill and a decode "
    "engine process with 1 thread each, each pinned to its own core. Every worker has its HTTP "
    "front on a thread of the benchmark process, and the requests go to the decode worker with "
    "x-densa-prefill and a placement token signed as the router signs it (no router in between). "
    "The pair shares a cluster secret, so every KV message carries its HMAC-SHA256 "
    "(docs/security.md): 'authentication' is the time P spent computing and D spent checking them.",
    "Decode ITL is the gap between consecutive streamed tokens of the short requests; the long "
    "prompts' own first tokens are in TTFT (and long-prompt TTFT).",
    "Where 2 cores make the split lose: the split gives each phase one core, so a long prompt "
    "takes about twice as long to ingest as on the co-located engine's two threads (long-prompt "
    "TTFT), and decode steps run on one core instead of two; the co-located engine also shares "
    "one copy of the weights and the KV pages never move. What the split buys is that a prompt "
    "being ingested no longer sits inside every decode step (decode ITL p99).",
    "Why it wins at scale: with many GPUs per pool, prefill and decode are sized separately, the "
    "prefill pool runs compute-bound batches of long prompts at full utilisation while the decode "
    "pool runs memory-bound batches without prefill chunks stalling them, and each pool keeps "
    "the formats that pay in its phase (FP8 KV, INT4 weights on decode: more requests in flight). "
    "The transfer costs bandwidth, not compute: here it is a copy over loopback TCP.",
    "Transfer figures are per transfer, averaged over a run's transfers (the short requests' "
    "and the long prompts' together); every run uses fresh prompts, so no run hits a prefix "
    "cache an earlier run filled.",
    "The reference split converts BF16 pages to FP8 at landing (landing + conversion ms); the "
    "same-format split copies bytes as they are.",
]
