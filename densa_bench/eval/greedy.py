"""`densa eval greedy`: do greedy generations stay token-identical to the reference format?

Every format generates greedily for the same chat prompts (the same token ids, submitted as one
batch, so every format sees the same schedule). Per format: how many generations equal the
reference's token for token, and where the others first diverge. One flipped near-tie changes
everything after it, so a divergence says where, not how bad: the distribution evaluation
measures how far apart the formats are.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from densa.engine.llm import LLM
from densa.sampling_params import SamplingParams
from densa.utils.logging import get_logger
from densa_bench.common.report import Table
from densa_bench.eval.common import load_formats
from densa_bench.eval.formats import Format
from densa_bench.eval.report import QualityReport, new_report
from densa_bench.eval.stats import DEFAULT_BOOTSTRAP, Bootstrap, Estimate, mean_ci, proportion_ci

logger = get_logger(__name__)

# Short, varied requests: facts, explanations, instructions, arithmetic, code, creative text.
DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn leaves.",
    "List three benefits of regular exercise.",
    "What is 17 multiplied by 23? Show your steps.",
    "Write a Python function that reverses a string.",
    "Summarize the plot of Romeo and Juliet.",
    "How do plants make food from sunlight?",
    "Give me a recipe for a simple tomato soup.",
    "What are the differences between a cat and a dog as pets?",
    "Translate 'Good morning, how are you?' into French.",
    "Describe the water cycle.",
    "Write a short email asking a colleague for a meeting next week.",
    "Who was Albert Einstein?",
    "What causes earthquakes?",
    "Suggest a name for a small coffee shop and explain the choice.",
    "How many days are there in a leap year, and why?",
    "Write a limerick about a programmer.",
    "What is the difference between weather and climate?",
    "Give three tips for learning a new language.",
    "Explain what a computer's memory is used for.",
    "Tell a short story about a robot who learns to paint.",
    "What is photosynthesis?",
    "Why is it important to sleep well?",
)


@dataclass(frozen=True)
class GreedySettings:
    num_prompts: int = 20
    max_tokens: int = 128
    prompts: tuple[str, ...] = DEFAULT_PROMPTS  # user messages, wrapped in the chat template

    def __post_init__(self) -> None:
        if not 1 <= self.num_prompts <= len(self.prompts):
            raise ValueError(f"num_prompts must be in [1, {len(self.prompts)}]")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def selected_prompts(self) -> tuple[str, ...]:
        return self.prompts[: self.num_prompts]


@dataclass(frozen=True)
class GreedyComparison:
    """One test format's generations against the reference's."""

    label: str
    token_ids: list[list[int]]
    texts: list[str]
    first_divergence: list[int | None]  # per prompt: first differing position; None = identical
    ref_lengths: list[int]  # per prompt: tokens the reference generated

    @property
    def num_identical(self) -> int:
        return sum(pos is None for pos in self.first_divergence)

    @property
    def diverged_at(self) -> list[int]:
        return [pos for pos in self.first_divergence if pos is not None]

    @property
    def mean_first_divergence(self) -> float | None:
        """Mean position of the first differing token, over the prompts that diverged."""
        return statistics.fmean(self.diverged_at) if self.diverged_at else None

    @property
    def matched_tokens(self) -> list[int]:
        """Per prompt: how many leading tokens equal the reference's (all of them if identical)."""
        return [
            length if pos is None else pos
            for pos, length in zip(self.first_divergence, self.ref_lengths, strict=True)
        ]

    def identical_share(self) -> Estimate:
        """Share of prompts generated token-identically, with its Wilson 95% interval."""
        return proportion_ci(self.num_identical, len(self.first_divergence))

    def mean_matched_tokens(self, bootstrap: Bootstrap = DEFAULT_BOOTSTRAP) -> Estimate:
        """Mean leading tokens equal to the reference's, bootstrapped over prompts."""
        return mean_ci(self.matched_tokens, bootstrap)

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "num_prompts": len(self.first_divergence),
            "num_identical": self.num_identical,
            "identical_share": self.identical_share().to_json(),
            "mean_matched_tokens": self.mean_matched_tokens().to_json(),
            "mean_first_divergence": self.mean_first_divergence,
            "first_divergence": self.first_divergence,
        }


def first_divergence(ref_ids: Sequence[int], test_ids: Sequence[int]) -> int | None:
    """The first position where two generations differ (one ending early counts); None if equal."""
    for pos, (a, b) in enumerate(zip(ref_ids, test_ids, strict=False)):
        if a != b:
            return pos
    return None if len(ref_ids) == len(test_ids) else min(len(ref_ids), len(test_ids))


# ---- generation ------------------------------------------------------------------------------
def generate_greedy(llm: LLM, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    results = llm.generate(prompt_ids, params, use_tqdm=sys.stderr.isatty())
    failed = [r.error for r in results if r.error]
    if failed:
        raise RuntimeError(f"generation failed: {failed[0]}")
    return [r.token_ids for r in results]


def compare_greedy(
    llms: Mapping[str, LLM], prompts: Sequence[str], max_tokens: int
) -> tuple[list[list[int]], list[GreedyComparison]]:
    """Generate with every format (the first is the reference) from the reference's tokens of
    the chat prompts; return the reference's outputs and one comparison per test format."""
    labels = list(llms)
    ref = llms[labels[0]]
    prompt_ids = [ref.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    logger.info("greedy: generating with %r", labels[0])
    ref_out = generate_greedy(ref, prompt_ids, max_tokens)
    comparisons = []
    for label in labels[1:]:
        logger.info("greedy: generating with %r", label)
        out = generate_greedy(llms[label], prompt_ids, max_tokens)
        comparisons.append(
            GreedyComparison(
                label=label,
                token_ids=out,
                texts=[ref.tokenizer.decode(ids) for ids in out],
                first_divergence=[
                    first_divergence(r, t) for r, t in zip(ref_out, out, strict=True)
                ],
                ref_lengths=[len(r) for r in ref_out],
            )
        )
    return ref_out, comparisons


# ---- the command -----------------------------------------------------------------------------
def run_greedy(ref: Format, tests: Sequence[Format], settings: GreedySettings) -> QualityReport:
    """Load every format, generate, and build the report (not yet written)."""
    formats = [ref, *tests]
    llms = load_formats(formats)
    prompts = settings.selected_prompts
    ref_out, comparisons = compare_greedy(
        {fmt.label: llm for fmt, llm in zip(formats, llms, strict=True)},
        prompts,
        settings.max_tokens,
    )
    report = new_report(
        "greedy",
        formats,
        {"num_prompts": len(prompts), "max_tokens": settings.max_tokens, "chat_template": True},
    )
    report.summary = [c.to_json() for c in comparisons]
    report.samples = _samples(llms[0], prompts, ref_out, comparisons)
    report.tables.append(_table(comparisons, settings.max_tokens))
    report.notes += _NOTES
    return report


def _samples(
    ref: LLM, prompts: Sequence[str], ref_out: list[list[int]], comparisons: list[GreedyComparison]
) -> list[dict[str, Any]]:
    return [
        {
            "prompt": prompt,
            "reference": ref.tokenizer.decode(ref_out[idx]),
            "tests": {
                c.label: {"text": c.texts[idx], "first_divergence": c.first_divergence[idx]}
                for c in comparisons
            },
        }
        for idx, prompt in enumerate(prompts)
    ]


def _table(comparisons: list[GreedyComparison], max_tokens: int) -> Table:
    rows = []
    for c in comparisons:
        mean = c.mean_first_divergence
        rows.append(
            [
                c.label,
                f"{c.num_identical} / {len(c.first_divergence)}",
                c.identical_share().format(".1f", scale=100),
                c.mean_matched_tokens().format(".1f"),
                "" if mean is None else f"{mean:.1f}",
                "" if mean is None else f"{min(c.diverged_at)}..{max(c.diverged_at)}",
            ]
        )
    columns = [
        "format",
        "token-identical to ref",
        "identical, % [95% CI]",
        "mean tokens equal to ref before the first divergence [95% CI]",
        f"mean first divergence (of {max_tokens} tokens; diverged prompts only)",
        "first divergence, min..max",
    ]
    return Table("Greedy generations vs the reference", columns, rows)


_NOTES = [
    "Each prompt is one user message in the model's chat template; decoding is greedy "
    "(temperature 0) and stops at EOS or max_tokens. Every format receives the same prompt "
    "token ids in one batch.",
    "A first divergence at position k means tokens 0..k-1 are identical. Greedy decoding "
    "amplifies near-ties: one flipped token changes the rest of the text, so this shows how "
    "often and how early formats part ways, not how different their distributions are "
    "(see densa eval distribution).",
    "Intervals: the identical share's is a Wilson score interval over prompts; the mean of "
    "leading tokens equal to the reference (a whole generation when identical) is a percentile "
    "bootstrap over prompts (2000 resamples, seed 0).",
]
