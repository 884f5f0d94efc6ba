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
from densa.sched.output import PackedPages


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


@dataclass(frozen=True)
class PromptState:
    """A proposer's state of a prompt of n tokens as it crosses a prefill/decode split (an MTP
    layer's: its rows of positions [0, n - 1), exact, each pairing h_p with the prompt's
    t_{p+1}, and h_{n-1}, which the decode side pairs with the first token to propose;
    docs/speculative.md)."""

    num_positions: int  # n - 1
    hidden: torch.Tensor  # h_{n-1}, float32 [1, H]
    page_ids: list[int]  # exporting: the proposer's pages holding the rows
    pages: PackedPages | None = None  # the rows, packed (exported, or as they arrived)


class PromptStates(Protocol):
    """A proposer whose state of a prompt crosses a prefill/decode split with its pages."""

    def export_prompt(self, request_id: str, prompt_token_ids: Sequence[int]) -> PromptState | None:
        """Prefill side: the prompt's state, packed; None when it cannot be made (the decode
        side then proposes without it)."""
        ...

    def land_prompt(self, request_id: str, state: PromptState) -> bool:
        """Decode side: take the state in; False (keeping nothing) if it cannot."""
        ...


class Proposer(Protocol):
    """Keeps whatever per-request state it needs; `release` drops it.

    A proposer with its own KV (a draft model) catches up from `token_ids` and truncates its own
    KV when the target rejected tokens (it compares `token_ids` with what it cached).

    What it needs of the target and of a split are capabilities it declares, read by whoever
    builds or drives it (never by asking which class it is).
    """

    name: str  # "ngram" | "draft" | "mtp" | "ngram+draft"
    # The target's final hidden states of every position a step computes (`observe_hidden`):
    # the runner keeps them only for a proposer that reads them (an MTP layer).
    needs_hidden_states: bool
    # Its state of a prompt, sent with the prompt's pages across a prefill/decode split (an
    # MTP layer's rows); None: nothing of it crosses.
    prompt_states: PromptStates | None
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
