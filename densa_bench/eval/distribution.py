"""`densa eval distribution`: next-token distributions of each format vs the reference.

Real English text runs teacher-forced through every engine (the paged KV path of serving, chunk
by chunk). At each position we compare the two next-token distributions:

    mean KL(ref || test)   nats per predicted token; 0 = identical distributions
    top-1 agreement        both formats rank the same token first
    perplexity             of the actual next tokens, per format, and test - ref

Only per-segment sums are kept (and one KL value per token for percentiles): [tokens, vocab]
distributions exist one chunk at a time. Intervals resample whole segments (see stats.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from densa.engine.llm import LLM
from densa.offline.scoring import iter_logits
from densa.quant.calibration_data import TEXT_SOURCE, lambada_passages
from densa.text.tokenizer import Tokenizer
from densa.utils.progress import progress
from densa_bench.common.report import Table
from densa_bench.eval.common import load_formats
from densa_bench.eval.formats import Format
from densa_bench.eval.report import IntervalPlot, QualityReport, interval_series, new_report
from densa_bench.eval.stats import (
    DEFAULT_BOOTSTRAP,
    Bootstrap,
    Estimate,
    Statistic,
    block_bootstrap,
    kl_divergence,
    ratio_ci,
    target_nll,
    top1_agreement,
)

PASSAGE_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class DistributionSettings:
    num_tokens: int = 20480  # rounded up to whole segments
    segment_len: int = 512  # tokens per independent unit of the bootstrap
    chunk_size: int = 512  # tokens per forward pass (memory: chunk x vocab fp32 per format)
    bootstrap: Bootstrap = DEFAULT_BOOTSTRAP

    def __post_init__(self) -> None:
        if self.segment_len < 2:
            raise ValueError(f"segment_len must be >= 2 (one prediction), got {self.segment_len}")
        if self.num_tokens < 1 or self.chunk_size < 1:
            raise ValueError("num_tokens and chunk_size must be >= 1")

    @property
    def num_segments(self) -> int:
        return math.ceil(self.num_tokens / self.segment_len)


# ---- text ------------------------------------------------------------------------------------
def text_segments(
    tokenizer: Tokenizer,
    num_segments: int,
    segment_len: int,
    passages: Sequence[str] | None = None,
) -> list[list[int]]:
    """Consecutive `segment_len`-token windows of one token stream: the passages (default:
    LAMBADA) in order, separated by blank lines, each tokenized on its own."""
    needed = num_segments * segment_len
    stream: list[int] = []
    for passage in lambada_passages() if passages is None else passages:
        stream += tokenizer.encode(passage + PASSAGE_SEPARATOR, add_special_tokens=False)
        if len(stream) >= needed:
            return [stream[i : i + segment_len] for i in range(0, needed, segment_len)]
    raise ValueError(f"the text has {len(stream)} tokens, fewer than the {needed} asked for")


# ---- results ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class FormatDivergence:
    """How far one test format's next-token distributions are from the reference's."""

    label: str
    mean_kl: Estimate
    top1_agreement: Estimate
    perplexity: Estimate
    perplexity_delta: Estimate  # test - ref, paired by segment
    kl_p99: float  # per-token KL percentiles: rare large disagreements hide in a small mean
    kl_max: float

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "mean_kl": self.mean_kl.to_json(),
            "top1_agreement": self.top1_agreement.to_json(),
            "perplexity": self.perplexity.to_json(),
            "perplexity_delta": self.perplexity_delta.to_json(),
            "kl_p99": self.kl_p99,
            "kl_max": self.kl_max,
        }


@dataclass(frozen=True)
class DistributionResult:
    ref_label: str
    ref_perplexity: Estimate
    formats: list[FormatDivergence]
    num_segments: int
    num_predictions: int  # scored positions: segment_len - 1 per segment

    def __getitem__(self, label: str) -> FormatDivergence:
        return next(f for f in self.formats if f.label == label)


@dataclass
class SegmentSums:
    """Per-segment sums of one test format (one list entry per segment)."""

    kl: list[float] = field(default_factory=list)
    agree: list[float] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    token_kl: list[torch.Tensor] = field(default_factory=list)

    def start_segment(self) -> None:
        self.kl.append(0.0)
        self.agree.append(0.0)
        self.nll.append(0.0)

    def add_chunk(
        self, ref_logprobs: torch.Tensor, test_logprobs: torch.Tensor, target_ids: torch.Tensor
    ) -> None:
        """Add one chunk's positions to the current segment."""
        kl = kl_divergence(ref_logprobs, test_logprobs)
        self.token_kl.append(kl)
        self.kl[-1] += float(kl.sum())
        self.agree[-1] += float(top1_agreement(ref_logprobs, test_logprobs).sum())
        self.nll[-1] += float(target_nll(test_logprobs, target_ids).sum())


# ---- comparison ------------------------------------------------------------------------------
def compare_distributions(
    llms: Mapping[str, LLM],
    segments: Sequence[list[int]],
    chunk_size: int = 512,
    bootstrap: Bootstrap = DEFAULT_BOOTSTRAP,
) -> DistributionResult:
    """Score every segment with every format in lockstep (the first is the reference) and
    compare each of the others with it."""
    ref_label, *test_labels = llms
    engines = [llms[label].engine for label in llms]
    sums = {label: SegmentSums() for label in test_labels}
    ref_nll: list[float] = []
    counts: list[float] = []
    with progress(len(segments), "distribution", "segment") as bar:
        for segment in segments:
            streams = [iter_logits(e, segment, chunk_size) for e in engines]
            ref_nll.append(accumulate_segment(streams, torch.tensor(segment[1:]), sums))
            counts.append(len(segment) - 1)
            bar.update()
    return divergence_result(ref_label, sums, ref_nll, counts, bootstrap)


def accumulate_segment(
    streams: Sequence[Iterator[torch.Tensor]],
    targets: torch.Tensor,
    sums: Mapping[str, SegmentSums],
) -> float:
    """Add one segment to every test format's sums; return the reference's NLL sum.

    streams: per format (the reference first, then the tests in `sums` order) the logits of
    consecutive scored positions in the same chunks; row i of the concatenation predicts
    targets[i]. A final row past the targets (it predicts past the text) is ignored.
    """
    for label in sums:
        sums[label].start_segment()
    ref_nll, offset = 0.0, 0
    for ref_logits, *test_logits in zip(*streams, strict=True):
        rows = min(len(ref_logits), len(targets) - offset)
        chunk_targets = targets[offset : offset + rows]
        ref_lp = torch.log_softmax(ref_logits[:rows], dim=-1)
        ref_nll += float(target_nll(ref_lp, chunk_targets).sum())
        for label, logits in zip(sums, test_logits, strict=True):
            test_lp = torch.log_softmax(logits[:rows], dim=-1)
            sums[label].add_chunk(ref_lp, test_lp, chunk_targets)
        offset += rows
    if offset != len(targets):
        raise ValueError(f"the streams scored {offset} positions of {len(targets)}")
    return ref_nll


def divergence_result(
    ref_label: str,
    sums: Mapping[str, SegmentSums],
    ref_nll: list[float],
    counts: list[float],
    bootstrap: Bootstrap,
) -> DistributionResult:
    """Every test format's estimates from its per-segment sums (`counts`: predictions per
    segment)."""
    ref_ppl = block_bootstrap({"nll": ref_nll, "n": counts}, _perplexity("nll"), bootstrap)
    formats = [_summarize(label, s, ref_nll, counts, bootstrap) for label, s in sums.items()]
    return DistributionResult(ref_label, ref_ppl, formats, len(counts), int(sum(counts)))


def _perplexity(column: str) -> Statistic:
    return lambda t: np.exp(t[column] / t["n"])


def _summarize(
    label: str, s: SegmentSums, ref_nll: list[float], counts: list[float], bootstrap: Bootstrap
) -> FormatDivergence:
    columns = {"ref": ref_nll, "test": s.nll, "n": counts}
    token_kl = torch.cat(s.token_kl).double()
    return FormatDivergence(
        label=label,
        mean_kl=ratio_ci(s.kl, counts, bootstrap),
        top1_agreement=ratio_ci(s.agree, counts, bootstrap),
        perplexity=block_bootstrap(columns, _perplexity("test"), bootstrap),
        perplexity_delta=block_bootstrap(
            columns, lambda t: np.exp(t["test"] / t["n"]) - np.exp(t["ref"] / t["n"]), bootstrap
        ),
        kl_p99=float(torch.quantile(token_kl, 0.99)),
        kl_max=float(token_kl.max()),
    )


# ---- the command -----------------------------------------------------------------------------
def run_distribution(
    ref: Format, tests: Sequence[Format], settings: DistributionSettings
) -> QualityReport:
    """Load every format, score the text, and build the report (not yet written)."""
    formats = [ref, *tests]
    llms = load_formats(formats)
    segments = text_segments(llms[0].tokenizer, settings.num_segments, settings.segment_len)
    result = compare_distributions(
        {fmt.label: llm for fmt, llm in zip(formats, llms, strict=True)},
        segments,
        settings.chunk_size,
        settings.bootstrap,
    )
    return distribution_report(result, ref, tests, settings)


def distribution_report(
    result: DistributionResult,
    ref: Format,
    tests: Sequence[Format],
    settings: DistributionSettings,
    name: str = "distribution",
) -> QualityReport:
    report = new_report(
        name,
        [ref, *tests],
        {
            "text": TEXT_SOURCE,
            "num_segments": result.num_segments,
            "segment_len": settings.segment_len,
            "num_predictions": result.num_predictions,
            "chunk_size": settings.chunk_size,
            "bootstrap": vars(settings.bootstrap),
        },
    )
    report.summary = [
        {"label": result.ref_label, "perplexity": result.ref_perplexity.to_json()},
        *(f.to_json() for f in result.formats),
    ]
    report.tables.append(_table(result))
    report.plots += _plots(result)
    report.notes += _notes(result, settings)
    return report


def _table(result: DistributionResult) -> Table:
    rows = [
        [f"{result.ref_label} (reference)", "0", "100", result.ref_perplexity.format(".3f"), ""]
    ]
    rows += [
        [
            f.label,
            f.mean_kl.format(".3g"),
            f.top1_agreement.format(".2f", scale=100),
            f.perplexity.format(".3f"),
            f.perplexity_delta.format(".3f"),
        ]
        for f in result.formats
    ]
    columns = [
        "format",
        "mean KL(ref‖test), nats [95% CI]",
        "top-1 agreement, % [95% CI]",
        "perplexity [95% CI]",
        "Δ perplexity vs ref [95% CI]",
    ]
    return Table("Next-token distributions vs the reference", columns, rows)


def _plots(result: DistributionResult) -> list[IntervalPlot]:
    labels = [f.label for f in result.formats]
    kl = IntervalPlot(
        name="kl",
        title="Mean KL(ref‖test) per token, 95% CI",
        x_label="format",
        y_label="nats",
        series=[interval_series("KL", [f.mean_kl for f in result.formats])],
        categories=labels,
        legend=False,
    )
    top1 = IntervalPlot(
        name="top1",
        title="Top-1 agreement with the reference, 95% CI",
        x_label="format",
        y_label="%",
        series=[interval_series("top-1", [f.top1_agreement for f in result.formats], 100)],
        categories=labels,
        reference_y=100.0,
        legend=False,
    )
    return [kl, top1]


MIN_SEGMENTS = 20  # fewer blocks than this and percentile intervals come out too narrow


def _notes(result: DistributionResult, settings: DistributionSettings) -> list[str]:
    b = settings.bootstrap
    notes = [
        f"Text: {TEXT_SOURCE}, joined by blank lines into one token stream and cut into "
        f"{result.num_segments} segments of {settings.segment_len} tokens "
        f"({result.num_predictions} scored next-token predictions).",
        f"Intervals: {b.confidence:.0%} percentile bootstrap over whole segments "
        f"({b.num_resamples} resamples, seed {b.seed}), not single tokens: tokens within a "
        "text are correlated, so resampling tokens would make the intervals too narrow.",
        "KL(ref‖test) is in nats, averaged over predicted tokens; top-1 agreement is the share "
        "of positions where both formats rank the same token first; Δ perplexity is test - ref "
        "on the same resampled segments (paired).",
        "Per-token KL percentiles (JSON: kl_p99, kl_max) show rare large disagreements that a "
        "small mean can hide: "
        + "; ".join(f"{f.label}: p99 {f.kl_p99:.4g}, max {f.kl_max:.4g}" for f in result.formats),
    ]
    if result.num_segments < MIN_SEGMENTS:
        notes.append(
            f"Only {result.num_segments} segments: bootstrap intervals from fewer than "
            f"{MIN_SEGMENTS} blocks come out too narrow; treat them as rough."
        )
    return notes
