"""Greedy generations: token-identical counts and the first divergence."""

from __future__ import annotations

import pytest

from densa.engine.llm import LLM
from densa.eval.greedy import DEFAULT_PROMPTS, GreedySettings, compare_greedy, first_divergence


@pytest.mark.parametrize(
    ("ref", "test", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([], [], None),
        ([1, 2, 3], [1, 9, 3], 1),
        ([4, 2], [1, 2], 0),
        ([1, 2], [1, 2, 3], 2),  # the reference stopped (EOS) where the test went on
        ([], [5], 0),
    ],
)
def test_first_divergence(ref: list[int], test: list[int], expected: int | None) -> None:
    assert first_divergence(ref, test) == expected


def test_identical_formats_generate_identical_tokens(tiny_llms: dict[str, LLM]) -> None:
    llms = {"ref": tiny_llms["ref"], "same": tiny_llms["same"]}
    ref_out, (same,) = compare_greedy(llms, DEFAULT_PROMPTS[:3], max_tokens=6)
    assert same.token_ids == ref_out and all(len(ids) == 6 for ids in ref_out)
    assert (same.num_identical, same.mean_first_divergence) == (3, None)


def test_settings_are_checked() -> None:
    assert len(GreedySettings().selected_prompts) == 20
    with pytest.raises(ValueError, match="num_prompts"):
        GreedySettings(num_prompts=len(DEFAULT_PROMPTS) + 1)
