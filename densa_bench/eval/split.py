"""`densa eval split`: what prefill/decode disaggregation costs in quality, against co-location.

Each text segment is cut at a page boundary into a prompt and a continuation. The reference
(one engine, e.g. fp32 weights + BF16 KV) and every co-located format compute the prompt in one
pass, then the continuation in chunks, teacher-forced. The split runs the same schedule across
two engines: the prompt on a prefill engine (its formats), whose K/V pages travel through the
real handoff (densa/disagg agents, in-process transport, conversion at landing) into a decode
engine (its formats), which maps them from its prefix cache and computes the continuation.

    segment   | prompt [0, P)                 | continuation [P, L)          |
    reference | ref engine                    | ref engine, chunks of C      |
    split     | prefill engine -> KV pages -> | decode engine, chunks of C   |
    scored    |                               | rows P .. L-2 (predict P+1..)|

Only rows the decode engine computes are scored, for every format alike: the row before them
(the first generated token) is the prefill engine's in the split, so it would only dilute.
Everything after the logits (KL, top-1, perplexity, segment-bootstrap CIs, the report) is the
distribution evaluation's (distribution.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from densa.engine.llm_engine import LLMEngine
from densa.offline.inproc_pair import InProcessPair
from densa.offline.scoring import cached_scoring_request, score_positions, scoring_request
from densa.utils.progress import progress
from densa_bench.common.report import Table
from densa_bench.eval.common import load_formats
from densa_bench.eval.distribution import (
    DistributionResult,
    DistributionSettings,
    SegmentSums,
    accumulate_segment,
    distribution_report,
    divergence_result,
    text_segments,
)
from densa_bench.eval.formats import Format, split_options
from densa_bench.eval.report import QualityReport
from densa_bench.eval.stats import Bootstrap, Estimate, block_bootstrap

PROMPT_CHUNK = 512  # tokens per forward pass over a prompt (the scheduler's default budget)


@dataclass(frozen=True)
class SplitSettings:
    text: DistributionSettings = field(
        default_factory=lambda: DistributionSettings(num_tokens=10240, chunk_size=16)
    )
    prompt_len: int | None = None  # None: half a segment, rounded down to whole pages

    def resolved_prompt_len(self, page_size: int) -> int:
        """The prompt length; ValueError unless whole pages with a continuation to score."""
        segment_len = self.text.segment_len
        prompt_len = self.prompt_len or segment_len // 2 // page_size * page_size
        if prompt_len % page_size or not 0 < prompt_len < segment_len - 1:
            raise ValueError(
                f"the prompt must be whole pages of {page_size} tokens, at least one page and "
                f"leave 2+ tokens of the {segment_len}-token segment; got {prompt_len}"
            )
        return prompt_len


@dataclass(frozen=True)
class SplitFormats:
    """The reference, the split's two sides, and further co-located formats to compare. The
    decode formats co-located are always compared: the split must cost no more than they do."""

    ref: Format
    prefill: Format
    decode: Format
    colocated: list[Format]

    @property
    def split_label(self) -> str:
        return f"split {self.prefill.label} -> {self.decode.label}"


@dataclass
class HandoffTally:
    """What crossed the transport, summed over segments (the evidence that prompts moved)."""

    num_handoffs: int = 0
    num_pages: int = 0
    num_bytes: int = 0
    prompt_tokens_from_cache: int = 0  # decode-side prompt tokens mapped, not computed
    prompt_tokens: int = 0


# ---- logits of one segment -----------------------------------------------------------------
def colocated_logits(
    engine: LLMEngine, segment: list[int], prompt_len: int, chunk_size: int
) -> Iterator[torch.Tensor]:
    """[chunk, vocab] logits of the continuation positions, after the prompt in one engine."""
    with scoring_request(engine, segment, len(segment)) as request:
        for start in range(0, prompt_len, PROMPT_CHUNK):
            end = min(start + PROMPT_CHUNK, prompt_len)
            score_positions(engine, request, segment[start:end], start)  # its K/V, not its rows
        for start in range(prompt_len, len(segment), chunk_size):
            yield score_positions(engine, request, segment[start : start + chunk_size], start)


def split_logits(
    pair: InProcessPair,
    segment: list[int],
    prompt_len: int,
    chunk_size: int,
    scope: str,
    tally: HandoffTally,
) -> Iterator[torch.Tensor]:
    """The same rows as `colocated_logits`, with the prompt's K/V from the prefill engine.

    `scope` must be fresh: then the decode engine's prefix cache can hold this prompt's blocks
    only because the handoff landed them, and a hit of the whole prompt proves it moved."""
    handoff = pair.handoff(segment[:prompt_len], scope)
    decode = pair.decode
    with cached_scoring_request(decode, segment, scope, kind="split") as (request, num_cached):
        if handoff.first_block != 0 or num_cached != prompt_len:
            raise RuntimeError(
                f"the decode engine holds {num_cached} of the {prompt_len} prompt tokens "
                f"(handoff from block {handoff.first_block}): the prompt did not come over whole"
            )
        tally.num_handoffs += 1
        tally.num_pages += handoff.num_pages
        tally.num_bytes += handoff.num_bytes
        tally.prompt_tokens_from_cache += num_cached
        tally.prompt_tokens += prompt_len
        for start in range(prompt_len, len(segment), chunk_size):
            yield score_positions(decode, request, segment[start : start + chunk_size], start)


# ---- the comparison --------------------------------------------------------------------------
@dataclass(frozen=True)
class SplitResult:
    distribution: DistributionResult
    split_label: str
    versus_label: str  # the decode formats co-located
    kl_delta: Estimate  # mean KL: split - co-located decode formats, paired by segment
    top1_delta: Estimate  # top-1 agreement: split - co-located decode formats
    tally: HandoffTally
    prompt_len: int


def compare_split(
    ref: LLMEngine,
    pair: InProcessPair,
    colocated: dict[str, LLMEngine],
    split_label: str,
    segments: Sequence[list[int]],
    prompt_len: int,
    chunk_size: int = 16,
    bootstrap: Bootstrap | None = None,
    ref_label: str = "ref",
) -> SplitResult:
    """Score every segment's continuation in the split and in every co-located engine, against
    the reference. The first co-located engine is the one the split is judged against."""
    bootstrap = bootstrap or DistributionSettings().bootstrap
    sums = {split_label: SegmentSums(), **{label: SegmentSums() for label in colocated}}
    tally = HandoffTally()
    ref_nll: list[float] = []
    counts: list[float] = []
    with progress(len(segments), "split", "segment") as bar:
        for idx, segment in enumerate(segments):
            streams = [
                colocated_logits(ref, segment, prompt_len, chunk_size),
                split_logits(pair, segment, prompt_len, chunk_size, f"eval-split-{idx}", tally),
                *(colocated_logits(e, segment, prompt_len, chunk_size) for e in colocated.values()),
            ]
            targets = torch.tensor(segment[prompt_len + 1 :])
            ref_nll.append(accumulate_segment(streams, targets, sums))
            counts.append(len(targets))
            bar.update()
    versus = next(iter(colocated))
    deltas = _paired_deltas(sums[split_label], sums[versus], counts, bootstrap)
    result = divergence_result(ref_label, sums, ref_nll, counts, bootstrap)
    return SplitResult(result, split_label, versus, *deltas, tally, prompt_len)


def _paired_deltas(
    split: SegmentSums, versus: SegmentSums, counts: list[float], bootstrap: Bootstrap
) -> tuple[Estimate, Estimate]:
    """(mean KL, top-1) of the split minus the co-located format's, on the same resampled
    segments: the paired interval of "does the split cost more than its formats?"."""
    columns = {"kl_s": split.kl, "kl_v": versus.kl, "a_s": split.agree, "a_v": versus.agree}
    columns["n"] = counts

    def diff(a: str, b: str) -> Estimate:
        return block_bootstrap(columns, lambda t: (t[a] - t[b]) / t["n"], bootstrap)

    return diff("kl_s", "kl_v"), diff("a_s", "a_v")


# ---- the command -----------------------------------------------------------------------------
def run_split(formats: SplitFormats, settings: SplitSettings) -> QualityReport:
    """Load the engines, score the text, build the report (not yet written)."""
    # The decode formats load twice: the split's decode engine, and the same formats co-located.
    all_formats = [formats.ref, formats.prefill, formats.decode, formats.decode, *formats.colocated]
    loaded = load_formats(all_formats)
    ref, prefill, decode, *colocated = (llm.engine for llm in loaded)
    prompt_len = settings.resolved_prompt_len(decode.config.cache.page_size)
    text = settings.text
    segments = text_segments(loaded[0].tokenizer, text.num_segments, text.segment_len)
    labels = [f"co-located {formats.decode.label}", *(f.label for f in formats.colocated)]
    engines = dict(zip(labels, colocated, strict=True))
    pair = InProcessPair(prefill, decode)
    try:
        result = compare_split(
            ref, pair, engines, formats.split_label, segments, prompt_len, text.chunk_size,
            text.bootstrap, formats.ref.label,
        )  # fmt: skip
    finally:
        pair.close()
    return split_report(result, formats, settings)


def split_report(
    result: SplitResult, formats: SplitFormats, settings: SplitSettings
) -> QualityReport:
    split = dataclasses.replace(formats.decode, label=result.split_label)
    versus = dataclasses.replace(formats.decode, label=result.versus_label)
    tests = [split, versus, *formats.colocated]
    report = distribution_report(
        result.distribution, formats.ref, tests, settings.text, name="pd_split_distribution"
    )
    _describe_split_format(report, formats)
    report.settings.update(_split_settings(result))
    report.summary.append(
        {
            "label": f"{result.split_label} minus {result.versus_label}",
            "mean_kl_delta": result.kl_delta.to_json(),
            "top1_agreement_delta": result.top1_delta.to_json(),
        }
    )
    report.tables.insert(2, _delta_table(result))
    report.notes[0:0] = _split_notes(result, settings)
    return report


def _describe_split_format(report: QualityReport, formats: SplitFormats) -> None:
    """The formats table's split row: both sides' options (those not shared by every engine,
    as in the other rows), not the decode's alone."""
    engines = [formats.ref, formats.prefill, formats.decode, *formats.colocated]
    _, differing = split_options(engines)
    sides = {"prefill": differing[1], "decode": differing[2]}
    report.formats[1]["options"] = sides
    report.tables[0].rows[1][1] = "; ".join(
        f"{side}: " + (", ".join(f"{k}={v}" for k, v in opts.items()) or "the shared options")
        for side, opts in sides.items()
    )


def _split_settings(result: SplitResult) -> dict[str, object]:
    tally = result.tally
    return {
        "prompt_len": result.prompt_len,
        "prompt_chunk": PROMPT_CHUNK,
        "handoffs": tally.num_handoffs,
        "pages_landed": tally.num_pages,
        "bytes_landed": tally.num_bytes,
        "decode_prompt_tokens_from_transfer": tally.prompt_tokens_from_cache,
    }


def _split_notes(result: SplitResult, settings: SplitSettings) -> list[str]:
    tally, p = result.tally, result.prompt_len
    per_handoff = tally.num_bytes / max(1, tally.num_handoffs) / 2**20
    verdict = _verdict(result.kl_delta, result.top1_delta)
    return [
        f"Split point: the first {p} tokens of each {settings.text.segment_len}-token segment "
        f"are the prompt, computed in passes of {PROMPT_CHUNK}; the continuation is computed in "
        f"chunks of {settings.text.chunk_size} (most of its attention reads cached pages, as in "
        f"decode) and its rows {p}..{settings.text.segment_len - 2} are scored, for every "
        "format alike.",
        f"Transfer: {tally.num_handoffs} handoffs through the KV agents (in-process transport), "
        f"{tally.num_pages} pages, {per_handoff:.2f} MiB per prompt; the decode engine mapped "
        f"{tally.prompt_tokens_from_cache} of {tally.prompt_tokens} prompt tokens from the "
        "landed pages (fresh cache scope per segment) and computed none of them.",
        f"Split vs the decode formats co-located (paired by segment): Δ mean KL "
        f"{result.kl_delta.format('.3g')} nats, Δ top-1 {result.top1_delta.format('+.2f', 100)} "
        f"points. {verdict}",
    ]


def _verdict(kl_delta: Estimate, top1_delta: Estimate) -> str:
    if kl_delta.high <= 0 and top1_delta.low >= 0:
        return "The split costs no more than its formats co-located (both intervals say so)."
    if kl_delta.low > 0 or top1_delta.high < 0:
        return "The split costs MORE than its formats co-located."
    return "No difference is resolved at this sample size (an interval spans 0)."


def _delta_table(result: SplitResult) -> Table:
    rows = [
        [
            f"{result.split_label} minus {result.versus_label}",
            result.kl_delta.format(".3g"),
            result.top1_delta.format("+.2f", scale=100),
        ]
    ]
    columns = ["difference", "Δ mean KL, nats [95% CI]", "Δ top-1 agreement, points [95% CI]"]
    return Table("The split vs its formats co-located (paired by segment)", columns, rows)
