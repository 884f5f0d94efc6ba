"""`densa eval choice`: multiple-choice accuracy per format, by log-likelihood.

Each choice is scored as sum log p(choice | question); the highest sum is the answer
(`accuracy`). `accuracy_norm` divides each sum by the choice's length in characters first, so
long choices are not penalized for their length. Formats answer the same questions, so the
difference test - ref is bootstrapped by question (paired), which cancels question difficulty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from densa.engine.llm import LLM
from densa.utils.progress import progress
from densa_bench.common.data import TASKS, ChoiceItem, chance_accuracy, load_task
from densa_bench.common.report import Table
from densa_bench.eval.common import load_formats
from densa_bench.eval.formats import Format
from densa_bench.eval.prefix_scoring import score_continuations
from densa_bench.eval.report import IntervalPlot, QualityReport, interval_series, new_report
from densa_bench.eval.stats import (
    DEFAULT_BOOTSTRAP,
    Bootstrap,
    Estimate,
    mean_ci,
    paired_difference_ci,
)

ALL_TASKS = "all"
# (plot name, TaskAccuracy attribute, what the title calls it)
PLOTTED_DELTAS = (
    ("accuracy_delta", "delta", "accuracy"),
    ("accuracy_norm_delta", "delta_norm", "acc_norm"),
)


@dataclass(frozen=True)
class ChoiceSettings:
    tasks: tuple[str, ...] = tuple(TASKS)
    limit: int | None = 250  # questions per task (a seeded sample); None = every question
    sample_seed: int = 0
    chunk_size: int = 512
    bootstrap: Bootstrap = DEFAULT_BOOTSTRAP

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown or not self.tasks:
            raise ValueError(f"tasks must be some of {', '.join(TASKS)}; got {unknown or 'none'}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")


@dataclass(frozen=True)
class ItemScores:
    """One format's scores for the choices of one question."""

    logprobs: tuple[float, ...]  # sum of the choice's token log-probabilities
    num_chars: tuple[int, ...]  # length of each scored continuation

    @property
    def predicted(self) -> int:
        return int(np.argmax(self.logprobs))

    @property
    def predicted_norm(self) -> int:
        return int(np.argmax(np.array(self.logprobs) / np.array(self.num_chars)))


@dataclass(frozen=True)
class TaskAccuracy:
    """One format on one task (or all tasks pooled); deltas are None for the reference."""

    task: str
    label: str
    num_questions: int
    accuracy: Estimate
    accuracy_norm: Estimate
    delta: Estimate | None = None  # test - ref, paired by question
    delta_norm: Estimate | None = None
    same_answer: float | None = None  # share of questions where test picks ref's answer

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"task": self.task, "label": self.label, "n": self.num_questions}
        for name in ("accuracy", "accuracy_norm", "delta", "delta_norm"):
            value = getattr(self, name)
            out[name] = value.to_json() if value is not None else None
        out["same_answer"] = self.same_answer
        return out


@dataclass(frozen=True)
class ChoiceResult:
    items: list[ChoiceItem]
    scores: dict[str, list[ItemScores]]  # label -> one per item; the first label is the reference
    accuracies: list[TaskAccuracy]

    def get(self, task: str, label: str) -> TaskAccuracy:
        return next(a for a in self.accuracies if a.task == task and a.label == label)


# ---- scoring ---------------------------------------------------------------------------------
def score_item(llm: LLM, item: ChoiceItem, chunk_size: int = 512) -> ItemScores:
    """Score every choice of one question, computing the shared question once."""
    tokenizer = llm.tokenizer
    continuations = [item.continuation(idx) for idx in range(len(item.choices))]
    logprobs = score_continuations(
        llm.engine,
        tokenizer.encode(item.context),
        [tokenizer.encode(text, add_special_tokens=False) for text in continuations],
        chunk_size,
    )
    return ItemScores(tuple(logprobs), tuple(len(text) for text in continuations))


def compare_choices(
    llms: Mapping[str, LLM],
    items: Sequence[ChoiceItem],
    chunk_size: int = 512,
    bootstrap: Bootstrap = DEFAULT_BOOTSTRAP,
) -> ChoiceResult:
    """Score every item with every format (the first is the reference) and compare."""
    scores: dict[str, list[ItemScores]] = {label: [] for label in llms}
    with progress(len(items), "choice", "question") as bar:
        for item in items:
            for label, llm in llms.items():
                scores[label].append(score_item(llm, item, chunk_size))
            bar.update()
    tasks = list(dict.fromkeys(item.task for item in items))
    groups = {task: [i for i, it in enumerate(items) if it.task == task] for task in tasks}
    if len(tasks) > 1:
        groups[ALL_TASKS] = list(range(len(items)))
    accuracies = [
        acc
        for task, idx in groups.items()
        for acc in _task_accuracies(
            task,
            [items[i] for i in idx],
            {label: [s[i] for i in idx] for label, s in scores.items()},
            bootstrap,
        )
    ]
    return ChoiceResult(list(items), scores, accuracies)


def _task_accuracies(
    task: str,
    items: list[ChoiceItem],
    scores: Mapping[str, list[ItemScores]],
    bootstrap: Bootstrap,
) -> list[TaskAccuracy]:
    """Accuracies of every format on these items; paired deltas for all but the first."""
    answers = np.array([item.answer_idx for item in items])
    picks = {label: np.array([s.predicted for s in ss]) for label, ss in scores.items()}
    picks_norm = {label: np.array([s.predicted_norm for s in ss]) for label, ss in scores.items()}
    ref_label = next(iter(scores))
    ref, ref_norm = picks[ref_label] == answers, picks_norm[ref_label] == answers
    out = []
    for label in scores:
        correct, correct_norm = picks[label] == answers, picks_norm[label] == answers
        acc = TaskAccuracy(
            task, label, len(items), mean_ci(correct, bootstrap), mean_ci(correct_norm, bootstrap)
        )
        if label != ref_label:
            acc = dataclasses.replace(
                acc,
                delta=paired_difference_ci(ref, correct, bootstrap),
                delta_norm=paired_difference_ci(ref_norm, correct_norm, bootstrap),
                same_answer=float(np.mean(picks[label] == picks[ref_label])),
            )
        out.append(acc)
    return out


# ---- the command -----------------------------------------------------------------------------
def load_items(settings: ChoiceSettings) -> list[ChoiceItem]:
    return [
        item
        for task in settings.tasks
        for item in load_task(task, settings.limit, settings.sample_seed)
    ]


def run_choice(ref: Format, tests: Sequence[Format], settings: ChoiceSettings) -> QualityReport:
    """Load every format, score the questions, and build the report (not yet written)."""
    items = load_items(settings)
    formats = [ref, *tests]
    llms = load_formats(formats)
    result = compare_choices(
        {fmt.label: llm for fmt, llm in zip(formats, llms, strict=True)},
        items,
        settings.chunk_size,
        settings.bootstrap,
    )
    return choice_report(result, formats, settings)


def choice_report(
    result: ChoiceResult, formats: Sequence[Format], settings: ChoiceSettings
) -> QualityReport:
    counts = {task: sum(it.task == task for it in result.items) for task in settings.tasks}
    report = new_report(
        "choice",
        formats,
        {
            "tasks": list(settings.tasks),
            "questions_per_task": counts,
            "limit": settings.limit,
            "sample_seed": settings.sample_seed,
            "chunk_size": settings.chunk_size,
            "bootstrap": vars(settings.bootstrap),
        },
    )
    report.summary = [acc.to_json() for acc in result.accuracies]
    report.samples = _samples(result)
    report.tables.append(_table(result))
    report.plots += _plots(result, [f.label for f in formats[1:]])
    report.notes += _notes(result, settings)
    return report


def _samples(result: ChoiceResult) -> list[dict[str, Any]]:
    return [
        {
            "task": item.task,
            "id": item.item_id,
            "answer": item.answer_idx,
            "formats": {
                label: {
                    "logprobs": s[idx].logprobs,
                    "predicted": s[idx].predicted,
                    "predicted_norm": s[idx].predicted_norm,
                }
                for label, s in result.scores.items()
            },
        }
        for idx, item in enumerate(result.items)
    ]


def _table(result: ChoiceResult) -> Table:
    def pct(e: Estimate | None) -> str:
        return "" if e is None else e.format(".1f", scale=100)

    rows = [
        [
            a.task,
            str(a.num_questions),
            _chance_text(result, a.task),
            a.label,
            pct(a.accuracy),
            pct(a.delta),
            pct(a.accuracy_norm),
            pct(a.delta_norm),
            "" if a.same_answer is None else f"{a.same_answer * 100:.1f}",
        ]
        for a in result.accuracies
    ]
    columns = [
        "task", "questions", "chance, %", "format", "accuracy, % [95% CI]",
        "Δ vs ref, points [95% CI]", "acc_norm, % [95% CI]", "Δ acc_norm, points [95% CI]",
        "same answer as ref, %",
    ]  # fmt: skip
    return Table("Multiple-choice accuracy (log-likelihood)", columns, rows)


def _chance_text(result: ChoiceResult, task: str) -> str:
    return f"{chance_accuracy(_task_items(result, task)) * 100:.1f}"


def _plots(result: ChoiceResult, test_labels: list[str]) -> list[IntervalPlot]:
    tasks = list(dict.fromkeys(a.task for a in result.accuracies))
    plots = []
    for name, attr, what in PLOTTED_DELTAS:
        series = [
            interval_series(label, [getattr(result.get(task, label), attr) for task in tasks], 100)
            for label in test_labels
        ]
        plots.append(
            IntervalPlot(
                name=name,
                title=f"Δ {what} vs the reference (test - ref), paired 95% CI",
                x_label="task",
                y_label="points",
                series=series,
                categories=tasks,
            )
        )
    return plots


def _notes(result: ChoiceResult, settings: ChoiceSettings) -> list[str]:
    b = settings.bootstrap
    ref_label = next(iter(result.scores))
    near_chance = [
        a.task
        for a in result.accuracies
        if a.label == ref_label and a.accuracy.low <= chance_accuracy(_task_items(result, a.task))
    ]
    notes = [
        "Cloze scoring: the prompt is `Question: <question>\\nAnswer:` (HellaSwag: "
        "`<activity>: <context>`) and each choice is the continuation ` <choice text>`; the "
        "answer is the choice with the highest summed log-probability (accuracy) or the "
        "highest per-character log-probability (acc_norm).",
        f"Questions: a seeded sample (seed {settings.sample_seed}) of at most {settings.limit} "
        "per task: ARC-Easy / ARC-Challenge / HellaSwag validation, MMLU test (all subjects).",
        f"Intervals: {b.confidence:.0%} percentile bootstrap over questions ({b.num_resamples} "
        f"resamples, seed {b.seed}); Δ is paired: the same resampled questions for both formats.",
        "'same answer as ref' counts questions where the test format picks the reference's "
        "choice, right or wrong: the most sensitive of these numbers.",
    ]
    if near_chance:
        notes.append(
            f"The reference's accuracy interval reaches chance on: {', '.join(near_chance)}. "
            "There the accuracy deltas say little about a format; use KL and top-1 agreement "
            "(densa eval distribution) instead."
        )
    return notes


def _task_items(result: ChoiceResult, task: str) -> list[ChoiceItem]:
    return [it for it in result.items if task in (ALL_TASKS, it.task)]
