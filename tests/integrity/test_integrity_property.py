"""Property: under random admit / step / abort / preempt sequences with injected bookkeeping faults,
every fault is caught (at the next step's check or at release), nothing is flagged without a fault,
and the page pool stays consistent."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from densa.cache.kv_manager import KVCacheManager
from densa.cache.page_pool import PagePoolError
from densa.config import SchedulerConfig
from densa.request import Request, RequestStatus
from densa.sampling_params import SamplingParams
from densa.sched.events import ReleaseViolation
from densa.sched.mirror import RequestStates
from densa.sched.scheduler import Scheduler
from densa.worker.integrity import TagTableChecker

NUM_PAGES, PAGE_SIZE = 24, 4
SHARED_PREFIX = list(range(500, 512))


class IntegrityMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        config = SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=20, max_model_len=48)
        self.scheduler = Scheduler(config, KVCacheManager(NUM_PAGES, PAGE_SIZE))
        self.pool = self.scheduler.kv.pool
        self.checker = TagTableChecker(list(range(NUM_PAGES)), PAGE_SIZE, torch.device("cpu"))
        self.mirror = RequestStates()  # the runner's view, built from the scheduler's deltas
        self.stale: dict[str, set[int]] = {}  # request -> page indices it maps but no longer owns
        self.corrupt: dict[
            str, tuple[int, int]
        ] = {}  # next step: request -> (page idx, wrong page)
        self.thief_pages: list[int] = []  # pages reused by "someone else" after a fault
        self.released: list[tuple[int, int]] = []  # (page, tag) pairs of past releases
        self.num_requests = 0

    # ---- normal operation ----------------------------------------------------------------------
    @rule(prompt_len=st.integers(1, 20), max_tokens=st.integers(1, 10), shared=st.booleans())
    def add(self, prompt_len: int, max_tokens: int, shared: bool) -> None:
        prompt = (SHARED_PREFIX if shared else []) + [1000 + self.num_requests] * prompt_len
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(Request(f"r{self.num_requests}", prompt[:40], params))
        self.num_requests += 1

    @rule()
    def step(self) -> None:
        out = self.scheduler.schedule()
        scheduled = [self._maybe_corrupt(item) for item in self.mirror.apply(out)]
        self.checker.apply_tag_updates(out.tag_updates)
        flagged = set(self.checker.check_step(scheduled))
        must_flag = {
            s.request_id
            for s in scheduled
            if self.stale.get(s.request_id) or s.request_id in self.corrupt
        }
        assert flagged == must_flag
        self.corrupt.clear()
        for request_id in flagged:
            self._finish(request_id, RequestStatus.FINISHED_ERROR)
        sampled = {s.request_id: 7 for s in scheduled if s.sample and s.request_id not in flagged}
        for request in self.scheduler.update_from_output(out, sampled):
            if request.is_finished:
                self._after_release(request.request_id)
        self._check_release_reports()

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        self._finish(request_id, RequestStatus.FINISHED_ABORTED)

    # ---- faults --------------------------------------------------------------------------------
    @precondition(lambda self: self._owned_pages())
    @rule(data=st.data(), reuse=st.booleans())
    def fault_release_behind_owner(self, data: st.DataObject, reuse: bool) -> None:
        request_id, idx = data.draw(st.sampled_from(self._owned_pages()))
        page = self.scheduler.requests[request_id].page_ids[idx]
        self.pool.free([page])
        self.stale.setdefault(request_id, set()).add(idx)
        if reuse:
            self.pool.move_to_front(page)
            assert self.pool.allocate(1) == [page]
            self.thief_pages.append(page)

    @precondition(lambda self: any(r.page_ids for r in self.scheduler.running))
    @rule(data=st.data())
    def fault_corrupt_page_table(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from([r for r in self.scheduler.running if r.page_ids]))
        idx = data.draw(st.integers(0, len(request.page_ids) - 1))
        wrong = data.draw(
            st.integers(0, NUM_PAGES - 1).filter(lambda p: p != request.page_ids[idx])
        )
        self.corrupt[request.request_id] = (idx, wrong)

    @precondition(lambda self: any(self.pool.ref_count(p) == 0 for p in range(NUM_PAGES)))
    @rule(data=st.data())
    def fault_double_free(self, data: st.DataObject) -> None:
        page = data.draw(
            st.sampled_from([p for p in range(NUM_PAGES) if self.pool.ref_count(p) == 0])
        )
        with pytest.raises(PagePoolError):
            self.pool.free([page])

    @precondition(lambda self: self.released)
    @rule(data=st.data())
    def fault_late_write(self, data: st.DataObject) -> None:
        page, tag = data.draw(st.sampled_from(self.released))
        # A released writer never passes the ownership check (even on a page still shared by
        # others, whose tag did not change); the device table catches every reallocated page.
        assert self.scheduler.kv.check_writer("late", None, [page], [tag]) is not None
        self.checker.apply_tag_updates(self.pool.drain_tag_updates())  # as the engine does
        if self.pool.tag(page) != tag:
            assert self.checker.check_write("late", [page], [tag]) is not None

    # ---- invariants ----------------------------------------------------------------------------
    @invariant()
    def pool_is_consistent(self) -> None:
        owners: dict[str, list[int]] = {"thief": list(self.thief_pages)}
        for request_id, request in self.scheduler.requests.items():
            stale = self.stale.get(request_id, set())
            owners[request_id] = [p for i, p in enumerate(request.page_ids) if i not in stale]
        self.pool.check_consistency(owners)

    @invariant()
    def owners_always_pass_the_write_check(self) -> None:
        for request_id, request in self.scheduler.requests.items():
            if request.page_ids and not self.stale.get(request_id):
                pages, tags = request.page_ids, request.page_tags
                assert self.checker.check_write(request_id, pages, tags) is None
                exclusive = [
                    (p, t) for p, t in zip(pages, tags, strict=True) if self.pool.ref_count(p) == 1
                ]
                assert (
                    self.scheduler.kv.check_writer(
                        request_id, request, [p for p, _ in exclusive], [t for _, t in exclusive]
                    )
                    is None
                )

    # ---- helpers -------------------------------------------------------------------------------
    def _owned_pages(self) -> list[tuple[str, int]]:
        return [
            (r.request_id, i)
            for r in self.scheduler.running
            for i, p in enumerate(r.page_ids)
            if self.pool.ref_count(p) == 1 and i not in self.stale.get(r.request_id, set())
        ]

    def _maybe_corrupt(self, item):  # type: ignore[no-untyped-def]
        if item.request_id not in self.corrupt:
            return item
        idx, wrong = self.corrupt[item.request_id]
        if idx >= -(-item.end_pos // PAGE_SIZE):  # that entry is not touched this step
            del self.corrupt[item.request_id]
            return item
        pages = list(item.page_ids)
        pages[idx] = wrong
        from dataclasses import replace

        return replace(item, page_ids=pages)

    def _finish(self, request_id: str, status: RequestStatus) -> None:
        request = self.scheduler.requests[request_id]
        self.released.extend(zip(request.page_ids, request.page_tags, strict=True))
        self.scheduler.finish_request(request_id, status)
        self._after_release(request_id)
        self._check_release_reports()

    def _after_release(self, request_id: str) -> None:
        self.corrupt.pop(request_id, None)

    def _check_release_reports(self) -> None:
        events = self.scheduler.drain_events()
        reported = {e.violation.request_id for e in events if isinstance(e, ReleaseViolation)}
        assert reported <= {rid for rid, idx in self.stale.items() if idx}, (
            "false positive at release"
        )
        for request_id in reported:
            self.stale.pop(request_id)
        # A stale request that released its pages (finish or preemption) must have been reported.
        for request_id in list(self.stale):
            request = self.scheduler.requests.get(request_id)
            if self.stale[request_id] and (request is None or not request.page_ids):
                raise AssertionError(f"{request_id} released stale pages unreported")


IntegrityMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestIntegrityProperty = IntegrityMachine.TestCase
