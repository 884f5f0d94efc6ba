"""Prompt lookup: propose what followed the latest earlier occurrence of the request's last tokens.

Agent and coding traffic repeats long spans of its own context (a file being edited, a tool's
output quoted back), and there the tokens after an earlier copy of the last few tokens are very
often the next ones. No model runs: a proposal costs a scan of the request's token ids.

    token_ids:  ... a b c X Y Z ... a b c |        n = 3: the tail "a b c" occurred before,
                        ^^^^^^^ proposed              what followed it ("X Y Z") is proposed

The longest tail (max_ngram) is tried first: a longer match is stronger evidence. A tail of fewer
than min_ngram tokens is never matched: one token recurs too often to predict what follows it.
"""

from __future__ import annotations

from collections.abc import Sequence

from densa.cache.integrity import IntegrityViolation
from densa.spec.proposer import PromptStates, SpecInput, TargetRows

DEFAULT_MIN_NGRAM = 2
DEFAULT_MAX_NGRAM = 4


class NgramProposer:
    """Stateless: each proposal reads only the request's tokens, so release has nothing to drop."""

    name = "ngram"
    needs_hidden_states = False
    prompt_states: PromptStates | None = None  # nothing of it crosses a split
    cost_per_token = 0.0  # a scan of token ids, nothing beside a decode step
    catch_up_cost_per_token = 0.0

    def __init__(self, min_ngram: int = DEFAULT_MIN_NGRAM, max_ngram: int = DEFAULT_MAX_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def propose(self, inputs: Sequence[SpecInput]) -> list[list[int]]:
        return [self.lookup(list(item.token_ids), item.num_tokens) for item in inputs]

    def lookup(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to num_tokens tokens that followed the latest earlier occurrence of the longest
        matching tail (max_ngram down to min_ngram tokens); [] when no tail occurred before."""
        for n in range(min(self.max_ngram, len(token_ids) - 1), self.min_ngram - 1, -1):
            start = _latest_earlier_match(token_ids, n)
            if start is not None:
                return token_ids[start + n : start + n + num_tokens]
        return []

    def release(self, request_id: str) -> None:
        return None

    def observe_hidden(self, request_id: str, rows: TargetRows) -> None:
        return None

    def take_violations(self) -> list[IntegrityViolation]:
        return []  # no pages of its own


def _latest_earlier_match(token_ids: list[int], n: int) -> int | None:
    """Start of the latest occurrence of the last n tokens that ends before the last token."""
    tail = token_ids[-n:]
    last = tail[-1]
    # end: index of the occurrence's last token; at most len - 2, so a token follows it.
    for end in range(len(token_ids) - 2, n - 2, -1):
        if token_ids[end] == last and token_ids[end - n + 1 : end + 1] == tail:
            return end - n + 1
    return None
