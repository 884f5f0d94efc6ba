"""L1: the state of one request as the scheduler and KV manager see it. Pure data, no torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from densa.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages
    RUNNING = "running"  # holds pages, scheduled every step
    PREEMPTED = "preempted"  # pages taken back; waits to recompute its tokens
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context length
    FINISHED_ABORTED = "abort"  # client went away or cancelled
    FINISHED_ERROR = "error"  # the engine refused to continue it (e.g. a KV integrity violation)

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass
class Request:
    """One generation request.

    Token accounting (the scheduler schedules tokens, not phases):

        all_token_ids:  [ prompt ............ | output ....... ]
                        0            num_computed_tokens     num_tokens
                        |<-- K/V in pages -->|<-- to compute -->|

    A prefill chunk, a decode step and a recompute after preemption are all "compute the next
    tokens past num_computed_tokens".
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_scope: str = ""  # prefix-cache namespace (tenant); pages are shared only within a scope
    session_id: str | None = None  # x-session-affinity
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    # Pages this request maps, in order, and the generation tag each page had when it was mapped.
    # Invariant: len(page_ids) == len(page_tags); page_ids[i] holds positions [i*P, (i+1)*P).
    page_ids: list[int] = field(default_factory=list)
    page_tags: list[int] = field(default_factory=list)
    # How many page-table entries the runner has been sent since this request's admission.
    num_pages_sent: int = 0
    # Speculative decoding (docs/speculative.md). Tokens a proposer guessed to follow this
    # request's last token, for the next step to verify (the engine sets them, schedule takes them).
    spec_token_ids: list[int] = field(default_factory=list)
    # Proposed tokens the last step accepted: their K/V is in the pages already (the verifying
    # step wrote it), so no chunk computes them; the next chunk tells the runner about them.
    unsent_token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    # Disaggregation (densa/disagg): while a KV transfer may still write into this request's pages
    # (decode side) or read from them (prefill side), finishing it must not free them: the
    # scheduler moves them to its held set until the transfer's state machine releases them.
    hold_pages: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logits(self) -> bool:
        """It reports its prompt's logprobs and has not had them all yet (it has no output
        token): every prompt position must be computed here, since pages mapped from the prefix
        cache hold K/V but no logits. Once it has output, a recompute may map them again."""
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids

    def token_at(self, idx: int) -> int:
        num_prompt = len(self.prompt_token_ids)
        if idx < num_prompt:
            return self.prompt_token_ids[idx]
        return self.output_token_ids[idx - num_prompt]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]
