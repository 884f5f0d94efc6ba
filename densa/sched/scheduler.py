"""Continuous batching: every step, decide which tokens of which requests to compute.

Policy (first come, first served; never deadlocks, never starves):
1. Running requests, oldest first, get their next tokens (1 for decode, a chunk for prefill) under
   the per-step token budget. When the pool has no page for one, the newest running request is
   preempted (pages freed, recomputed later) until it fits -- or it is itself the newest and waits.
2. If nobody was preempted, waiting requests are admitted in arrival order (prefix hits first),
   each with as large a prefill chunk as the budget leaves, while pages and sequence slots last.
   The queue head is never skipped for lack of room, so a large request cannot be starved by
   small ones. The one exception: a request whose prefix is being read from a KV tier (held in
   `fetching`, for a bounded time) is passed over, so a slow tier never delays anyone else.

Since the pool always holds at least one max_model_len request (checked at start-up), the oldest
request can always make progress.

Fault confinement: the per-request parts of a step (admitting one request, growing one request's
pages, indexing one request's full pages) are guarded one request at a time. If one raises, that
request alone ends with an `engine_error` (its pages freed); the rest of the step goes on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Sequence

from densa.cache.integrity import IntegrityViolation
from densa.cache.kv_manager import NO_HIT, KVCacheManager
from densa.config import SchedulerConfig
from densa.request import Request, RequestStatus
from densa.sched.chunks import chunk_of, new_request_of
from densa.sched.events import ReleaseViolation, RequestEnded, SchedulerEvent
from densa.sched.output import KVExport, KVLanding, NewRequest, ScheduledChunk, SchedulerOutput
from densa.sched.remote import RemoteRequests, RemoteReservation
from densa.sched.stop import StopRule

logger = logging.getLogger(__name__)
# The error a request ends with when its own bookkeeping raised (a bug, confined to it).
INTERNAL_ERROR = "engine_error: internal error while {what} this request; it was ended alone"


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.stop = StopRule.of(config)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_step: list[str] = []
        self._preempted_since_step: list[str] = []
        self._admitted_this_step: list[NewRequest] = []
        self.num_preemptions = 0  # lifetime total, for metrics
        # Lifetime total of tokens sampled, delivered or not: with the tokens handed to clients
        # it shows how much work abandoned requests cost before they were aborted.
        self.num_generated_tokens = 0
        # What the scheduler did on its own since the engine last looked (drain_events).
        self._events: list[SchedulerEvent] = []
        # Disaggregation (see densa/disagg): requests whose prompt K/V comes from another worker,
        # and pages of finished requests that a transfer may still touch.
        self.remote = RemoteRequests(kv_manager)
        # Waiting requests not to admit yet: their prefix pages are on the way up from a KV tier
        # (engine/kv_tiers.py asks: hold_for_fetch, end_fetch). Admission passes over them,
        # keeping their place in the queue: a tier lookup delays only the request that asked
        # (it ends by a deadline).
        self._fetching: set[str] = set()
        # Requests outside the queues whose positions the offline API scores (scoring_step),
        # by id: the runner has been told of them.
        self._scoring: set[str] = set()

    # ---- request lifecycle ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the context holds "
                f"{self.config.max_model_len} including at least one output token"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(
        self, request_id: str, status: RequestStatus, error: str | None = None
    ) -> Request | None:
        """End a request (abort, stop string, integrity error...). Frees its pages. Idempotent."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._unqueue(request)
        self.remote.forget(request_id)
        self._fetching.discard(request_id)
        request.status = status
        request.error = error
        if request.hold_pages and request.page_ids:
            self.remote.hold(request)
        else:
            self._release(request)
        self.kv.forget(request)
        self._finished_since_step.append(request_id)
        return request

    def reset_counters(self) -> None:
        """Start the lifetime totals from zero (after a warm-up)."""
        self.num_generated_tokens = self.num_preemptions = 0

    def drain_events(self) -> list[SchedulerEvent]:
        events, self._events = self._events, []
        return events

    def _release(self, request: Request) -> None:
        self._events.extend(ReleaseViolation(v) for v in self.kv.free(request))

    def _end_on_own(self, request: Request, error: str) -> None:
        """End a request by the scheduler's own decision, and say so to the engine."""
        self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR, error)
        self._events.append(RequestEnded(request.request_id, RequestStatus.FINISHED_ERROR, error))

    def _unqueue(self, request: Request) -> None:
        # By identity, and wherever it is: a request that failed half-way through admission may
        # have left the waiting queue before it was marked running.
        for queue in (self.running, self.waiting):
            for idx, queued in enumerate(queue):
                if queued is request:
                    del queue[idx]
                    return

    # ---- KV tiers: a waiting request held while its prefix is read (engine/kv_tiers.py) --------
    def hold_for_fetch(self, request_id: str) -> None:
        """Pass the waiting request over at admission until `end_fetch` (it keeps its place)."""
        self._fetching.add(request_id)

    def end_fetch(self, request_id: str) -> None:
        """Admit the request again (its fetched pages are in the prefix cache, or none came)."""
        self._fetching.discard(request_id)

    @property
    def fetching(self) -> frozenset[str]:
        """The waiting requests held for a fetch (read-only)."""
        return frozenset(self._fetching)

    # ---- disaggregation hooks (densa/disagg drives them; see docs/disaggregation.md) -----------
    def add_remote(self, request: Request) -> None:
        """Track a request whose prompt K/V will be copied in: it waits for reserve_remote."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.remote.add(request)

    def is_receiving(self, request_id: str) -> bool:
        """Is the request alive and still waiting for its prompt's K/V to land?"""
        return request_id in self.remote.receiving

    def reserve_remote(self, request_id: str) -> RemoteReservation | None:
        """Map a receiving request's prefix hit and allocate (and tag) pages for the rest of its
        prompt, before any byte moves; None (nothing changed) while there is no room or no
        sequence slot."""
        if len(self.running) + self.remote.num_reserved >= self.config.max_num_seqs:
            return None
        return self.remote.reserve(request_id)

    def queue_landing(self, landing: KVLanding) -> IntegrityViolation | None:
        """Queue a receiving request's copied-in K/V for the next step (its runner writes it);
        the violation, with nothing queued, if the writer no longer owns every page alone. The
        caller ends the request then."""
        return self.remote.queue_landing(landing)

    def _land(self, landing: KVLanding) -> Request | None:
        """The step wrote the request's prompt K/V: run it from its first token as if it had
        been prefilled here. None if it ended meanwhile (e.g. the runner refused the write)."""
        request = self.remote.landed(landing.request_id)
        if request is None:
            return None
        request.num_cached_tokens = max(request.num_cached_tokens, landing.num_cached_tokens)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = request.num_prompt_tokens
        self.running.append(request)
        self.kv.cache_full_pages(request)  # only now: the pages hold what their hashes say
        assert landing.first_token_id is not None  # only a request's landing starts it
        request.output_token_ids.append(landing.first_token_id)
        status = self._stop_status(request, landing.first_token_id)
        if status is not None:
            self.finish_request(request.request_id, status)
        else:  # the runner learns it now, its first token included (penalties see it)
            self._admitted_this_step.append(new_request_of(request))
        return request

    def release_held(self, owner_id: str) -> None:
        """Free the pages a finished request left held for a transfer (idempotent)."""
        self._events.extend(ReleaseViolation(v) for v in self.remote.release(owner_id))

    def held_page_ids(self, owner_id: str) -> list[int] | None:
        """A finished request's held pages in block order (None: it holds none)."""
        return self.remote.held_page_ids(owner_id)

    @property
    def held(self) -> dict[str, tuple[list[int], list[int]]]:
        """Held pages by owner, tail first (read-only: use release_held)."""
        return self.remote.held

    @property
    def num_held_pages(self) -> int:
        return self.remote.num_held_pages

    @property
    def has_schedulable(self) -> bool:
        """Is there anything a step could compute or write? (receiving requests wait for their
        pages; once their pages arrive, a step lands them)"""
        return bool(self.running or self.waiting or self.remote.has_landings)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledChunk] = []
        budget = self._schedule_running(budget, scheduled)
        if not self._preempted_since_step:
            self._schedule_waiting(budget, scheduled)
        output = SchedulerOutput(
            scheduled=scheduled,
            tag_updates=self.kv.drain_tag_updates(),
            finished_request_ids=self._finished_since_step,
            preempted_request_ids=self._preempted_since_step,
            new_requests=self._admitted_this_step,
            kv_landings=self.remote.take_landings(),
        )
        self._finished_since_step, self._preempted_since_step = [], []
        self._admitted_this_step = []
        return output

    def side_step(
        self, exports: Sequence[KVExport] = (), ended_ids: Sequence[str] = ()
    ) -> SchedulerOutput:
        """A step that computes nothing, between scheduled steps: the runner's tags brought up
        to date, `exports` copied out (held pages a KV transfer sends), and scored requests that
        ended (`ended_ids`) dropped. Requests the queues ended or admitted wait for the next
        scheduled step, as they would without it."""
        self._scoring.difference_update(ended_ids)
        return SchedulerOutput([], self.kv.drain_tag_updates(), list(ended_ids), [],
                               kv_exports=list(exports))  # fmt: skip

    def scoring_step(
        self, request: Request, token_ids: list[int], start_pos: int
    ) -> SchedulerOutput:
        """A step of one request outside the queues (the offline API's teacher-forced scoring,
        which allocates its pages itself): `token_ids` computed at positions from `start_pos`,
        nothing sampled. The runner is told of the request with its first such step; a
        side_step naming it in `ended_ids` drops it."""
        new = [] if request.request_id in self._scoring else [new_request_of(request)]
        self._scoring.add(request.request_id)
        chunk = dataclasses.replace(chunk_of(request, start_pos, 0, sample=False),
                                    token_ids=list(token_ids))  # fmt: skip
        return SchedulerOutput([chunk], self.kv.drain_tag_updates(), [], [], new_requests=new)

    def _schedule_running(self, budget: int, scheduled: list[ScheduledChunk]) -> int:
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            spec_token_ids = self._spec_tokens(request, num_new, budget - num_new)
            try:
                fits = self._allocate_or_preempt(request, num_new + len(spec_token_ids))
            except Exception:
                self._fail_alone(request, "scheduling")
                continue  # the list shrank: idx now points at the next request
            if not fits:
                break  # the request preempted itself: everything after it is gone too
            scheduled.append(self._scheduled(request, num_new, spec_token_ids))
            budget -= num_new + len(spec_token_ids)
            idx += 1
        return budget

    def _spec_tokens(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The proposals this step verifies for `request` (taken from it): only on a decode
        step, within the step's token budget and the context (every proposed position must fit
        in max_model_len)."""
        proposed, request.spec_token_ids = request.spec_token_ids, []
        if num_new != 1 or request.num_computed_tokens + 1 != request.num_tokens:
            return []
        room = self.config.max_model_len - request.num_tokens
        return proposed[: max(0, min(budget, room))]

    def _allocate_or_preempt(self, request: Request, num_new: int) -> bool:
        while True:
            if self.kv.allocate_slots(request, num_new) is not None:
                return True
            victim = self.running[-1]
            if victim is request and len(self.running) == 1:
                # Alone and still no room: it can never fit. Fail it rather than spin forever.
                self._end_on_own(
                    request, "kv_cache_exhausted: the request outgrew the whole KV cache"
                )
                return False
            self._preempt(victim)
            if victim is request:
                return False

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledChunk]) -> None:
        max_num_seqs = self.config.max_num_seqs
        idx = 0  # the first waiting request not passed over (those before it are fetching)
        while idx < len(self.waiting) and budget > 0 and len(self.running) < max_num_seqs:
            request = self.waiting[idx]
            if request.request_id in self._fetching:
                idx += 1  # its prefix is on the way up from a tier: the ones behind go first
                continue
            try:
                num_new = self._admit(request, budget)  # leaves the queue unless None
            except Exception:
                self._fail_alone(request, "admitting")
                continue
            if num_new is None:
                return  # no room for this one; later arrivals wait behind it
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

    def _admit(self, request: Request, budget: int) -> int | None:
        """Move the queue head to running with its first chunk; None (nothing changed) if the
        pool cannot hold it yet. Returns the number of tokens it computes this step."""
        hit = self.kv.find_prefix(request) if request.num_computed_tokens == 0 else NO_HIT
        num_hit_tokens = hit.num_tokens(self.kv.page_size)
        num_new = min(request.num_tokens - num_hit_tokens, budget)
        if self.kv.allocate_slots(request, num_new, hit) is None:
            return None
        self._unqueue(request)  # the queue head, or behind requests held for a KV tier
        if request.num_preemptions == 0:
            self.kv.record_prefix_query(request, hit)
            request.num_cached_tokens = num_hit_tokens
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._admitted_this_step.append(new_request_of(request))
        return num_new

    def _fail_alone(self, request: Request, what: str) -> None:
        """End one request whose own bookkeeping raised; its pages go back (checked by tag)."""
        logger.exception("error while %s request %s; ending it alone", what, request.request_id)
        self._end_on_own(request, INTERNAL_ERROR.format(what=what))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.spec_token_ids = []
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        self._preempted_since_step.append(request.request_id)

    def _scheduled(
        self, request: Request, num_new: int, spec_token_ids: list[int] | None = None
    ) -> ScheduledChunk:
        start = request.num_computed_tokens
        sample = start + num_new == request.num_tokens
        return chunk_of(request, start, num_new, sample, spec_token_ids or [])

    # ---- after the step ------------------------------------------------------------------------
    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: dict[str, int],
        accepted_token_ids: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests that hit a stop; run
        requests whose K/V the step landed from their first token.

        accepted_token_ids: per verifying request, the proposed tokens it accepted (they come
        before its sampled token). Returns the requests that got a new token or finished.
        """
        accepted = accepted_token_ids or {}
        updated = []
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished (e.g. aborted) after the step was scheduled
            token_id = sampled_token_ids.get(item.request_id)
            try:
                has_token = self._advance(
                    request, item, token_id, accepted.get(item.request_id, [])
                )
            except Exception:
                self._fail_alone(request, "updating")
                continue
            if has_token:
                updated.append(request)
        for landing in output.kv_landings:
            if not landing.starts_request:
                continue  # a KV tier's fetched blocks: engine/kv_tiers.py indexes them
            landed = self._land(landing)
            if landed is not None:
                updated.append(landed)
        return updated

    def _advance(
        self, request: Request, item: ScheduledChunk, token_id: int | None, accepted: list[int]
    ) -> bool:
        """Take in one request's step: computed tokens, its accepted and sampled tokens (cut at
        the first that stops it, as if they had come one step each), newly full pages."""
        request.num_computed_tokens = item.end_pos
        if token_id is None:
            self._roll_back(request, item)
            self.kv.cache_full_pages(request)
            return False
        status, num_new = None, 0
        for new_token_id in (*accepted, token_id):
            request.output_token_ids.append(new_token_id)
            self.num_generated_tokens += 1
            num_new += 1
            status = self._stop_status(request, new_token_id)
            if status is not None:
                break
        # The kept proposals' K/V, written by this step, stays; the rest rolls back. Full pages
        # are indexed before a stop frees them, so a finished request's prompt stays cached.
        num_kept = min(num_new, len(accepted))
        request.num_computed_tokens += num_kept
        self._roll_back(request, item)
        self.kv.cache_full_pages(request)  # only accepted tokens: pages past them are gone
        if status is not None:
            self.finish_request(request.request_id, status)
        else:
            request.unsent_token_ids.extend(accepted[:num_kept])
        return True

    def _roll_back(self, request: Request, item: ScheduledChunk) -> None:
        """Release the pages only rejected proposals reached (their tags change)."""
        if item.spec_token_ids:
            violations = self.kv.truncate(request, request.num_computed_tokens)
            self._events.extend(ReleaseViolation(v) for v in violations)

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        return self.stop.status(
            request.sampling_params, request.num_output_tokens, request.num_tokens, token_id
        )
