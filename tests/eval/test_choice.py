"""Multiple-choice scoring: shared-context log-likelihoods and paired accuracy deltas."""

from __future__ import annotations

import pytest

from densa.engine.llm import LLM
from densa.offline.scoring import token_logprobs
from densa_bench.common.data import load_task
from densa_bench.eval.choice import ALL_TASKS, ItemScores, compare_choices
from densa_bench.eval.prefix_scoring import score_continuations

CONTINUATIONS = [[7], [8, 9, 10], list(range(400, 425))]


# Context lengths around the page size (16): shorter, exactly one page, one page and a bit, and
# chunks shorter than a page so that both the shared part and the tails take several passes.
@pytest.mark.parametrize(("context_len", "chunk_size"), [(1, 512), (16, 512), (19, 7), (40, 7)])
def test_shared_context_scores_equal_whole_sequence_scores(
    tiny_llms: dict[str, LLM], context_len: int, chunk_size: int
) -> None:
    context = list(range(100, 100 + context_len))
    engine = tiny_llms["ref"].engine
    shared = score_continuations(engine, context, CONTINUATIONS, chunk_size)
    whole = [
        float(token_logprobs(engine, context + cont)[len(context) - 1 :].sum())
        for cont in CONTINUATIONS
    ]
    assert shared == pytest.approx(whole, abs=1e-4)
    engine.check_invariants()


def test_bad_continuations_are_refused(tiny_llms: dict[str, LLM]) -> None:
    engine = tiny_llms["ref"].engine
    with pytest.raises(ValueError, match="non-empty"):
        score_continuations(engine, [1, 2], [[3], []])
    with pytest.raises(ValueError, match="max_model_len is 1024"):
        score_continuations(engine, [1] * 1000, [[2] * 30])


def test_predictions_with_and_without_length_normalization() -> None:
    scores = ItemScores(logprobs=(-10.0, -12.0), num_chars=(10, 20))
    assert (scores.predicted, scores.predicted_norm) == (0, 1)  # -1.0 vs -0.6 per character


def test_identical_formats_have_a_zero_delta_with_a_zero_interval(
    tiny_llms: dict[str, LLM],
) -> None:
    items = load_task("arc_easy", limit=3) + load_task("hellaswag", limit=2)
    result = compare_choices({"ref": tiny_llms["ref"], "same": tiny_llms["same"]}, items)
    assert result.scores["ref"] == result.scores["same"]
    for task in ("arc_easy", "hellaswag", ALL_TASKS):
        same = result.get(task, "same")
        assert same.delta is not None and same.delta_norm is not None
        assert (same.delta.value, same.delta.low, same.delta.high) == (0.0, 0.0, 0.0)
        assert (same.delta_norm.low, same.delta_norm.high) == (0.0, 0.0)
        assert same.same_answer == 1.0
        assert same.accuracy == result.get(task, "ref").accuracy
    assert result.get(ALL_TASKS, "ref").num_questions == 5
