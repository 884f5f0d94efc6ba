"""Constrained decoding in the sampler: one grammar matcher per request, a token bitmask per step.

A matcher's state is a function of the request's constraint and its output tokens, both of
which every scheduled row carries. So the state is rebuilt from data when it is missing (the
first sample, or a worker that lost it) and re-synchronised before each mask: after a
preemption the request recomputes its KV but keeps its output tokens, and the matcher -- which
has consumed exactly those -- stays valid as it is.

    bitmask: int32 [N, ceil(V / 32)]; bit b of word w allows token 32 * w + b.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from densa.kernels.cpu.token_bitmask import apply_token_bitmask_
from densa.sampling_params import StructuredOutput
from densa.worker.grammar import GrammarCompiler, is_limit_error


@dataclass
class _MatcherState:
    matcher: Any  # llguidance.LLMatcher
    num_consumed: int = 0  # output tokens the matcher has consumed


@dataclass(frozen=True)
class StructuredRow:
    """One sampling row under a constraint."""

    row: int  # index into the logits
    request_id: str
    spec: StructuredOutput
    output_token_ids: Sequence[int]  # the request's output before this step's token


@dataclass
class MaskTimes:
    """Seconds spent filling and applying masks (densa bench structured reads these)."""

    fill_s: float = 0.0
    apply_s: float = 0.0
    num_masks: int = 0
    num_steps: int = 0


@dataclass
class StructuredSampler:
    compiler: GrammarCompiler
    _states: dict[str, _MatcherState] = field(default_factory=dict)
    _executor: Any = None  # llguidance.LLExecutor, for filling several rows in parallel
    _bitmask: np.ndarray | None = None  # the last one filled (what `accept` checks tokens against)
    times: MaskTimes = field(default_factory=MaskTimes)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._states)

    def fill_bitmask(self, rows: list[StructuredRow], num_rows: int) -> np.ndarray:
        """The allowed tokens of every constrained row ([num_rows, W]; other rows allow all).

        A matcher in an error state (a grammar that hit a resource limit) allows only EOS;
        `accept` then ends its request with the reason.
        """
        import llguidance.numpy as lln

        bitmask = lln.allocate_token_bitmask(num_rows, self.compiler.vocab_size)
        pairs = [(self._synced(r).matcher, r.row) for r in rows]
        if len(pairs) == 1:
            lln.fill_next_token_bitmask(pairs[0][0], bitmask, pairs[0][1])
        else:
            lln.fill_next_token_bitmask_par(self._parallel(), pairs, bitmask)
        self._bitmask = bitmask
        return bitmask

    def accept(self, rows: list[StructuredRow], token_ids: list[int]) -> dict[str, str]:
        """Advance each row's matcher by its sampled token; {request_id: error} for failures."""
        errors: dict[str, str] = {}
        for r in rows:
            state = self._states[r.request_id]
            token_id = token_ids[r.row]
            if state.matcher.is_error():  # it failed computing the mask (which allowed only EOS)
                errors[r.request_id] = _cannot_proceed(state.matcher)
            elif not self._was_allowed(r.row, token_id):  # the mask left nothing to sample
                errors[r.request_id] = _nothing_allowed(token_id)
            elif not state.matcher.consume_token(token_id):
                errors[r.request_id] = _refused(state.matcher, token_id)
            else:
                state.num_consumed += 1
        return errors

    def _was_allowed(self, row: int, token_id: int) -> bool:
        if self._bitmask is None:
            return True
        word = int(self._bitmask[row, token_id // 32])
        return bool((word >> (token_id % 32)) & 1)

    def _synced(self, r: StructuredRow) -> _MatcherState:
        state = self._states.get(r.request_id)
        if state is None:
            matcher = self.compiler.compile_now(r.spec).new_matcher()
            state = self._states[r.request_id] = _MatcherState(matcher)
        num_output = len(r.output_token_ids)
        if state.num_consumed > num_output:  # output was cut back: forget the extra tokens
            state.matcher.rollback(state.num_consumed - num_output)
            state.num_consumed = num_output
        if state.num_consumed < num_output:  # rebuilt state: replay the output so far
            state.matcher.consume_tokens(list(r.output_token_ids[state.num_consumed :]))
            state.num_consumed = num_output
        return state

    def _parallel(self) -> Any:
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        return self._executor


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> torch.Tensor:
    """logits [N, V] with the disallowed tokens of `rows` set to -inf (other rows unchanged).
    Works in place when the logits are contiguous float32 (the runner's always are)."""
    logits = logits.float().contiguous()
    apply_token_bitmask_(logits, bitmask[rows], rows)
    return logits


def _cannot_proceed(matcher: Any) -> str:
    # Either way the client's constraint is at fault, not the server: a 400 (invalid_grammar).
    reason = _reason(matcher)
    if is_limit_error(reason):  # the request's constraint outgrew the engine's bounds
        return (
            "invalid_grammar: the output constraint is too complex to follow at this point "
            f"({reason}); simplify the schema"
        )
    return f"invalid_grammar: the output constraint allows no next token here ({reason})"


def _nothing_allowed(token_id: int) -> str:
    # Every token the constraint allows is outside the model's logits (or penalised away).
    return (
        "grammar_error: the output constraint allows no token the model can write here "
        f"(token {token_id} was sampled from nothing)"
    )


def _refused(matcher: Any, token_id: int) -> str:
    # The token passed the mask, so the grammar engine contradicts itself: a server fault.
    return (
        f"grammar_error: the grammar engine refused token {token_id}, which its own mask "
        f"allowed ({_reason(matcher)})"
    )


def _reason(matcher: Any) -> str:
    # llguidance appends its parser state and the whole grammar: keep the first line.
    error = matcher.get_error().strip()
    return error.splitlines()[0] if error else "no reason given"
