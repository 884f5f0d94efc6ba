"""The receiving half of the step contract: a mirror of every running request, built from the
scheduler's deltas (the runner keeps one, in this process or another; so can anyone who reads
the steps, e.g. `densa bench step-bytes`). Plain data, like the deltas themselves.

The scheduler sends a request's prompt and parameters once (NewRequest) and then, per step, only
the tokens computed and the page-table entries mapped since the last step (ScheduledChunk). This
module keeps the rest -- the page table, its tags, prompt and output tokens -- and resolves each
chunk into a ScheduledRequest, the full view the batch builder, the integrity check and the
sampler read.

Each step's deltas are applied once (fault confinement re-runs only the computation of a failed
step). Resolving a chunk twice is still harmless: page grants apply by index and output tokens
are appended by position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from densa.sampling_params import SamplingParams
from densa.sched.output import NewRequest, ScheduledChunk, SchedulerOutput


class UnknownRequest(RuntimeError):
    """A chunk for a request the runner was never told about (a broken delta stream)."""


@dataclass
class RunnerRequest:
    """Everything the runner keeps about one running request."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    # After a speculative rollback the scheduler's page table is shorter than this mirror: the
    # entries past it are stale until granted again, and never read (a step reads only the
    # pages up to its own end).
    page_ids: list[int] = field(default_factory=list)
    page_tags: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def grant(self, index: int, page_id: int, tag: int) -> None:
        if index == len(self.page_ids):
            self.page_ids.append(page_id)
            self.page_tags.append(tag)
        elif index < len(self.page_ids):
            self.page_ids[index], self.page_tags[index] = page_id, tag
        else:
            raise UnknownRequest(f"page grant {index} skips entries ({len(self.page_ids)} known)")

    def take_tokens(self, start_pos: int, token_ids: list[int]) -> None:
        """Learn the generated tokens among positions [start_pos, start_pos + len(token_ids))."""
        for offset, token_id in enumerate(token_ids):
            position = start_pos + offset
            if position == self.num_tokens and position >= len(self.prompt_token_ids):
                self.output_token_ids.append(token_id)


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step, resolved against the runner's state. The lists are the
    runner's own (not copies): readers must not mutate them.

    Positions computed: [start_pos, start_pos + len(token_ids)), K/V into
    page_ids[pos // page_size] at slot pos % page_size; attention reads positions [0, end_pos).
    The last num_spec of token_ids are proposed tokens to verify (speculative decoding): every
    one of the last 1 + num_spec rows is sampled, as if each were a decode row of its own.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    page_ids: list[int]  # the request's whole page table after this step's allocation
    page_tags: list[int]  # the generation tag it expects on each of those pages
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_spec: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def spec_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_spec :]

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """A decode row: one generated token (and the proposals it verifies, each run as a
        decode row of its own). The one definition the runner uses, for the attention group
        (decode kernel), the phase's weights and CUDA graphs alike; a one-token chunk of a
        prompt is prefill."""
        return len(self.token_ids) - self.num_spec == 1 and self.start_pos >= len(
            self.prompt_token_ids
        )


class RequestStates:
    def __init__(self) -> None:
        self._requests: dict[str, RunnerRequest] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def apply(self, step: SchedulerOutput) -> list[ScheduledRequest]:
        """Bring the mirror up to date with `step` and resolve its chunks (same order). Apply each
        step once: an id can end and be reused in one step (its end is applied first)."""
        self.apply_lifecycle(step)
        return [self.resolve(chunk) for chunk in step.scheduled]

    def apply_lifecycle(self, step: SchedulerOutput) -> None:
        """Drop the requests that ended or were preempted; register the new ones."""
        for request_id in (*step.finished_request_ids, *step.preempted_request_ids):
            self._requests.pop(request_id, None)
        for new in step.new_requests:
            self.register(new)

    def register(self, new: NewRequest) -> None:
        if new.request_id not in self._requests:  # a retried step re-sends it
            self._requests[new.request_id] = RunnerRequest(
                list(new.prompt_token_ids), new.sampling_params, list(new.output_token_ids)
            )

    def drop(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def resolve(self, chunk: ScheduledChunk) -> ScheduledRequest:
        state = self._requests.get(chunk.request_id)
        if state is None:
            raise UnknownRequest(f"no NewRequest was sent for {chunk.request_id!r}")
        for grant in chunk.new_pages:
            state.grant(grant.index, grant.page_id, grant.tag)
        accepted = chunk.accepted_token_ids  # positions just before start_pos, in KV already
        state.take_tokens(chunk.start_pos - len(accepted), [*accepted, *chunk.token_ids])
        return ScheduledRequest(
            request_id=chunk.request_id,
            token_ids=[*chunk.token_ids, *chunk.spec_token_ids]
            if chunk.spec_token_ids
            else chunk.token_ids,
            start_pos=chunk.start_pos,
            page_ids=state.page_ids,
            page_tags=state.page_tags,
            sample=chunk.sample,
            sampling_params=state.sampling_params,
            prompt_token_ids=state.prompt_token_ids,
            output_token_ids=state.output_token_ids,
            num_spec=len(chunk.spec_token_ids),
        )
