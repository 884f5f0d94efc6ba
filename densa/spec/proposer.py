"""The one interface every proposer implements (n-gram prompt lookup, a draft model, MTP)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SpecInput:
    request_id: str
    # prompt + every output token accepted so far (the last one not yet in the target's KV)
    token_ids: Sequence[int]
    num_tokens: int  # how many tokens to propose at most (k for this request, >= 1)


class Proposer(Protocol):
    name: str  # "ngram" | "draft" | "mtp"

    def propose(self, inputs: Sequence[SpecInput]) -> list[list[int]]:
        """0..num_tokens proposed tokens for each input, in order."""
        ...

    def release(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: drop its state."""
        ...

    def observe_hidden(self, request_id: str, hidden: torch.Tensor) -> None:
        """MTP only: the target's last hidden states of accepted tokens; others ignore it."""
        ...
