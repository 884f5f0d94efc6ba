"""Prompt lookup proposes exactly what followed the latest earlier occurrence of the tail."""

from __future__ import annotations

import pytest

from densa.spec.ngram import NgramProposer
from densa.spec.proposer import SpecInput


def _propose(proposer: NgramProposer, tokens: list[int], k: int) -> list[int]:
    return proposer.propose([SpecInput("r", tokens, k)])[0]


def test_proposes_what_followed_the_tail() -> None:
    tokens = [5, 1, 2, 3, 7, 8, 9, 4, 1, 2, 3]
    assert _propose(NgramProposer(2, 4), tokens, 3) == [7, 8, 9]
    assert _propose(NgramProposer(2, 4), tokens, 10) == [7, 8, 9, 4, 1, 2, 3]


def test_latest_occurrence_wins() -> None:
    tokens = [1, 2, 10, 1, 2, 20, 1, 2]
    assert _propose(NgramProposer(2, 2), tokens, 1) == [20]


def test_longest_tail_is_tried_first() -> None:
    # "2 3" last occurred before 40, but the longer tail "1 2 3" only before 30.
    tokens = [1, 2, 3, 30, 9, 2, 3, 40, 1, 2, 3]
    assert _propose(NgramProposer(2, 3), tokens, 1) == [30]
    assert _propose(NgramProposer(2, 2), tokens, 1) == [40]


def test_no_match_or_too_short_tail_proposes_nothing() -> None:
    assert _propose(NgramProposer(2, 4), [1, 2, 3, 4, 5], 4) == []
    # The tail "7" (one token) occurred, but min_ngram 2 refuses it.
    assert _propose(NgramProposer(2, 4), [7, 1, 9, 7], 2) == []
    assert _propose(NgramProposer(1, 4), [7, 1, 9, 7], 2) == [1, 9]
    assert _propose(NgramProposer(1, 4), [7], 2) == []


def test_overlapping_repeats_propose_the_continuation() -> None:
    # A run of one token: the tail "5 5" last occurred one position earlier.
    assert _propose(NgramProposer(2, 4), [5, 5, 5, 5, 5], 3) == [5]
    assert _propose(NgramProposer(2, 2), [1, 2, 1, 2, 1, 2], 4) == [1, 2]


def test_batch_keeps_input_order() -> None:
    proposer = NgramProposer(2, 3)
    inputs = [SpecInput("a", [1, 2, 3, 1, 2], 2), SpecInput("b", [4, 5, 6], 2)]
    assert proposer.propose(inputs) == [[3, 1], []]


def test_bad_range_is_refused() -> None:
    with pytest.raises(ValueError, match="min_ngram"):
        NgramProposer(3, 2)
