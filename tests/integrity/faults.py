"""Test-only fault injection: the bookkeeping bugs that integrity tags must catch.

Nothing here is reachable from densa's API; each function breaks an invariant on purpose, the way a
real bug in preemption, eviction, transfer or block-table code would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from densa.engine.llm_engine import LLMEngine
from densa.sched.output import PageGrant, SchedulerOutput


def release_behind_owner(engine: LLMEngine, request_id: str, page_idx: int) -> int:
    """Free a page while its request still maps it (a use-after-free in waiting). Returns the page,
    placed first in the free queue so the next allocation reuses it."""
    request = engine.scheduler.requests[request_id]
    page_id = request.page_ids[page_idx]
    engine.kv_manager.pool.free([page_id])
    engine.kv_manager.pool.move_to_front(page_id)
    return page_id


def corrupt_next_page_table(
    engine: LLMEngine, request_id: str, page_idx: int, wrong_page: int
) -> None:
    """Make the next step hand the runner a page-table delta whose entry points at another page
    (the entry's tag stays the one its own page was mapped with)."""
    scheduler = engine.scheduler
    original: Callable[[], SchedulerOutput] = scheduler.schedule

    def schedule_once() -> SchedulerOutput:
        scheduler.schedule = original  # type: ignore[method-assign]
        out = original()
        tag = scheduler.requests[request_id].page_tags[page_idx]
        items = []
        for item in out.scheduled:
            if item.request_id == request_id:
                bad = PageGrant(page_idx, wrong_page, tag)
                item = replace(item, new_pages=[*item.new_pages, bad])
            items.append(item)
        return replace(out, scheduled=items)

    scheduler.schedule = schedule_once  # type: ignore[method-assign]
