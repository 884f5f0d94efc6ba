"""Prompt lookup first, the draft model only where it finds nothing (`--speculative-method
ngram+draft`).

Prompt lookup costs a scan of token ids and, where a request copies its context (file edits,
tool outputs), its guesses are the best there are; a draft model costs a decode step of a small
model per guess but guesses anywhere. This proposer asks prompt lookup for every request and the
draft model only for those with no match, in one batch. The draft keeps its K/V per request as
alone: a request it skipped for a few steps catches up on the tokens accepted since in one chunk
the next time it is asked (spec/draft.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from densa.cache.integrity import IntegrityViolation
from densa.spec.draft import DraftModelProposer
from densa.spec.ngram import NgramProposer
from densa.spec.proposer import PromptStates, SpecInput, TargetRows


class LookupFirstProposer:
    name = "ngram+draft"
    needs_hidden_states = False
    prompt_states: PromptStates | None = None  # nothing of it crosses a split

    def __init__(self, lookup: NgramProposer, draft: DraftModelProposer) -> None:
        self.lookup, self.draft = lookup, draft
        # The speculator picks k before it knows which of the two will answer: it prices every
        # guess as the draft's (the dearer), so a lookup match gets a k a draft would earn.
        self.cost_per_token = draft.cost_per_token
        # Unpriced: a lookup needs no catch-up, and which of the two answers is not known
        # before the request proposes.
        self.catch_up_cost_per_token = 0.0
        # Requests answered per proposer (lifetime), to tell how often the draft was needed.
        self.num_lookup_answers = 0
        self.num_draft_answers = 0

    def propose(self, inputs: Sequence[SpecInput]) -> list[list[int]]:
        proposals = self.lookup.propose(inputs)
        missed = [i for i, found in enumerate(proposals) if not found]
        self.num_lookup_answers += len(inputs) - len(missed)
        if missed:
            drafted = self.draft.propose([inputs[i] for i in missed])
            for i, tokens in zip(missed, drafted, strict=True):
                proposals[i] = tokens
            self.num_draft_answers += sum(1 for tokens in drafted if tokens)
        return proposals

    def release(self, request_id: str) -> None:
        self.draft.release(request_id)

    def observe_hidden(self, request_id: str, rows: TargetRows) -> None:
        """Neither reads the target's hidden states."""

    def take_violations(self) -> list[IntegrityViolation]:
        return self.draft.take_violations()
