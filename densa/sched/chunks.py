"""What the runner is told about a request, built from the scheduler's own state: the request
once at (re-)admission, and each chunk of tokens it is to compute, with the page-table entries
and accepted tokens it has not been sent yet (sending them marks them sent)."""

from __future__ import annotations

from densa.request import Request
from densa.sched.output import NewRequest, PageGrant, ScheduledChunk


def new_request_of(request: Request) -> NewRequest:
    """What the runner needs to know about `request` once, at (re-)admission."""
    request.num_pages_sent = 0  # the runner learns the page table from scratch
    request.unsent_token_ids = []  # ... and every output token
    return NewRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=request.sampling_params,
        output_token_ids=list(request.output_token_ids),
    )


def chunk_of(
    request: Request,
    start: int,
    num_new: int,
    sample: bool,
    spec_token_ids: list[int] | None = None,
) -> ScheduledChunk:
    """Tokens [start, start + num_new) of `request` (then spec_token_ids to verify), with the
    page-table entries and accepted tokens the runner has not been sent yet (which are then
    counted as sent)."""
    grants = [
        PageGrant(idx, request.page_ids[idx], request.page_tags[idx])
        for idx in range(request.num_pages_sent, len(request.page_ids))
    ]
    request.num_pages_sent = len(request.page_ids)
    accepted, request.unsent_token_ids = request.unsent_token_ids, []
    return ScheduledChunk(
        request_id=request.request_id,
        token_ids=request.token_slice(start, start + num_new),
        start_pos=start,
        new_pages=grants,
        sample=sample,
        spec_token_ids=spec_token_ids or [],
        accepted_token_ids=accepted,
    )
