"""What the scheduler hands the worker each step: one plain data object, read-only there."""

from __future__ import annotations

from dataclasses import dataclass, field

from densa.sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    Positions computed this step: [start_pos, start_pos + len(token_ids)). Its K/V goes into
    page_ids[pos // page_size] at slot pos % page_size. Attention reads positions [0, end_pos).
    """

    request_id: str
    token_ids: list[int]  # the tokens whose K/V is computed this step
    start_pos: int  # == num_computed_tokens before the step
    page_ids: list[int]  # the request's whole page table after this step's allocation
    page_tags: list[int]  # the generation tag it expects on each of those pages
    sample: bool  # the step reaches the last known token: sample the next one
    sampling_params: SamplingParams
    # Read-only views for penalties (prompt and output so far); the runner must not mutate them.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    # (page, tag) for every tag change since the last step -- pages allocated or released -- which
    # the worker mirrors into its device-side tag table before any read or write.
    tag_updates: list[tuple[int, int]]
    # Requests that ended or were preempted since the last step: the worker drops their state.
    finished_request_ids: list[str]
    preempted_request_ids: list[str]
    # Requests admitted (first scheduled, or re-admitted after preemption) in this step: the first
    # suspects when a step fails and the fault cannot be attributed (engine fault confinement).
    new_request_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
