"""The offline evaluation data loads into well-formed items for every task."""

from __future__ import annotations

import pytest

from densa.quant.calibration_data import lambada_passages
from densa_bench.common.data import TASKS, chance_accuracy, load_task

FULL_SIZES = {"arc_easy": 570, "arc_challenge": 299, "hellaswag": 10042, "mmlu": 14042}


@pytest.mark.parametrize("task", list(TASKS))
def test_every_item_is_well_formed(task: str) -> None:
    items = load_task(task)
    assert len(items) == FULL_SIZES[task]
    assert len({item.item_id for item in items}) == len(items)
    for item in items:
        assert item.task == task
        assert item.question.strip() and item.context.strip()
        assert len(item.choices) >= 3 and all(c.strip() for c in item.choices)
        assert 0 <= item.answer_idx < len(item.choices)
        assert item.continuation(0) == " " + item.choices[0]
    assert 0.24 < chance_accuracy(items) < 0.26


def test_cloze_prompts() -> None:
    arc = load_task("arc_easy")[0]
    assert arc.context == f"Question: {arc.question}\nAnswer:"
    assert (arc.choices[arc.answer_idx], arc.item_id) == ("cellular telephone", "MCAS_2000_4_6")
    hellaswag = load_task("hellaswag")
    assert not any("[" in item.context or "  " in item.context for item in hellaswag)
    assert hellaswag[0].context.startswith("Roof shingle removal: A man is sitting on a roof. He")


def test_a_limit_is_a_seeded_sample_across_the_task() -> None:
    sample = load_task("mmlu", limit=100, seed=0)
    assert len(sample) == 100
    assert [i.item_id for i in sample] == [i.item_id for i in load_task("mmlu", limit=100, seed=0)]
    assert [i.item_id for i in sample] != [i.item_id for i in load_task("mmlu", limit=100, seed=1)]
    assert len({item.item_id.split("/")[0] for item in sample}) > 30  # subjects, not one


def test_unknown_task() -> None:
    with pytest.raises(ValueError, match="unknown task 'gsm8k'"):
        load_task("gsm8k")


def test_lambada_passages_are_english_text() -> None:
    passages = lambada_passages()
    assert len(passages) == 5153
    assert passages[0].endswith("I don't care about signs")
    assert all(len(p.split()) > 20 for p in passages)
