"""The interface every proposer of speculative tokens implements.

A proposer guesses the next tokens of a request; the target model then scores the last accepted
token and the guesses in one forward and keeps the longest run it agrees with (worker/). Proposals
are deterministic (point masses), so the target's rejection sampling stays exact for sampling too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from densa.cache.integrity import IntegrityViolation


@dataclass(frozen=True)
class SpecInput:
    request_id: str
    # prompt + every output token accepted so far (the last one not yet in the target's KV)
    token_ids: Sequence[int]
    num_tokens: int  # how many tokens to propose at most (k for this request, >= 1)


@dataclass(frozen=True)
class TargetRows:
    """What one step put in the target's KV for good, for one request: positions
    [start_pos, start_pos + len(token_ids)), their tokens and the target's final hidden states
    ([len(token_ids), H]): a chunk's own tokens and the proposals accepted."""

    start_pos: int
    token_ids: list[int]
    hidden: torch.Tensor


class Proposer(Protocol):
    """Keeps whatever per-request state it needs; `release` drops it.

    A proposer with its own KV (a draft model) catches up from `token_ids` and truncates its own
    KV when the target rejected tokens (it compares `token_ids` with what it cached).
    """

    name: str  # "ngram" | "draft" | "mtp" | "ngram+draft"
    # What proposing one token costs, relative to one decode step of the target (the speculator
    # weighs it against what the token is expected to gain): 0 for prompt lookup.
    cost_per_token: float
    # What one context token it has not seen costs it, in target decode steps: a draft model
    # prefills a new prompt (or what came while it was paused) before its first guess. 0 where
    # catching up is free or happens anyway (prompt lookup, the MTP layer's folding).
    catch_up_cost_per_token: float

    def propose(self, inputs: Sequence[SpecInput]) -> list[list[int]]:
        """0..num_tokens tokens per input, in the order of `inputs`."""
        ...

    def release(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: drop its state."""
        ...

    def observe_hidden(self, request_id: str, rows: TargetRows) -> None:
        """MTP only: the target's hidden states of the positions a step kept; others ignore it."""
        ...

    def take_violations(self) -> list[IntegrityViolation]:
        """Pages of the proposer's own KV that a request found freed behind its back since the
        last call (the engine counts and logs them); [] for a proposer without pages."""
        ...
