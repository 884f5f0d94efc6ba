"""The engine's side of the KV tiers (densa/cache/tiers): pages go down when freed, and come back
up when a waiting request's prefix misses the device pool but a tier holds it. Device KV moves
only through the step (sched/output.py): this hook adds to it what to copy out and what to land,
and reads the runner's answer; it changes the scheduler's state only through its methods.

    every step, after schedule()    cached full pages that became free (a request ended or was
    (extend)                        preempted) or were evicted, and were not sent down before,
                                    are asked for as a KVExport: the runner packs them before
                                    the step (its landings included) writes any page; after the
                                    step (after_step) the background writer splits, seals and
                                    stores them in every tier. Sending at free time, not only at
                                    eviction, lets another worker fetch a session's history
                                    while this one still holds it.
    before schedule()               for the waiting requests that could be admitted next: the
    (before_schedule)               blocks after their device hit are looked up tier by tier
                                    (first tier that verifies wins, the chain stops at the first
                                    block no tier has) on a reader thread, while the engine keeps
                                    stepping; the request is held (Scheduler.hold_for_fetch, not
                                    admitted) until its blocks are in the prefix cache, and the
                                    requests behind it are admitted meanwhile.
    the step after a lookup ends    its blocks land as a KVLanding (the route a prefill worker's
    (extend, after_step)            pages take) in freshly allocated pages; once the runner wrote
                                    them they are indexed under their block hash and freed, and
                                    the request is let go: its admission hits them like any
                                    cached page.

A slow tier costs only the request that asked: the engine thread never waits on a lookup for
longer than IDLE_WAIT_S (and only with nothing else to run); a lookup starts no tier call after
its deadline (LOOKUP_DEADLINE_S: what it found by then lands), and one stuck inside a call past
that (a store that drips its answer, a hung network file system) is given up ABANDON_GRACE_S
later: the request computes its prefix. Lookups run on MAX_READERS threads, so one stuck call
does not queue every other request's lookup behind it.

A stored block's payload is one page's bytes as engine/tier_pages.py lays them out.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from densa.cache.kv_manager import KVCacheManager
from densa.cache.prefix_index import BlockHash
from densa.cache.tiers.shared import SharedTier
from densa.cache.tiers.tier import KVTier, logger
from densa.cache.tiers.writer import TierWriter
from densa.engine.hooks import StepHook, StepRecord
from densa.engine.tier_pages import PageLayout
from densa.request import Request
from densa.sched.output import KVExport, KVLanding, PackedPages, SchedulerOutput
from densa.sched.scheduler import Scheduler
from densa.utils.daemon_pool import DaemonPool

MAX_OFFERED_KEYS = 1 << 17  # blocks remembered as already sent down (skips re-copying a prefix)
MAX_READERS = 4  # lookups at once: a call stuck on one tier holds one reader, not all lookups
# A lookup starts no tier call after this long: what it found by then lands, the rest is
# computed (a prefix that takes longer to read than this is not worth holding a request for).
LOOKUP_DEADLINE_S = 2.0
ABANDON_GRACE_S = 0.5  # past the deadline by this much, a lookup stuck in a call is given up
IDLE_WAIT_S = 0.01  # nothing to run: how long a step waits for a lookup before it returns
CLOSE_WAIT_S = 5.0  # closing: how long to wait for readers still inside a tier call
EXPORT_ID = "kv-tier-write-back"  # the step's KVExport of pages on their way down
FETCH_WRITER = "kv-tier-fetch"  # a fetch's KVLanding writer id: kv-tier-fetch:<request id>


@dataclass(frozen=True)
class Lookup:
    """A waiting request's blocks being read from the tiers on the reader thread."""

    request: Request
    start: int  # the request's device hit, in blocks, when the lookup started
    keys: list[BlockHash]  # the block keys after it, in chain order
    future: Future[list[memoryview]]  # the payloads of the leading keys some tier had
    deadline: float  # monotonic: no tier call starts after it

    @property
    def is_stuck(self) -> bool:
        """Still inside a tier call well past its deadline: give it up."""
        return not self.future.done() and time.monotonic() > self.deadline + ABANDON_GRACE_S


@dataclass(frozen=True)
class Fetch:
    """A lookup's blocks landing in the current step: pages allocated for them, by the writer
    id of their KVLanding."""

    request_id: str
    keys: list[BlockHash]
    page_ids: list[int]
    tags: list[int]


class KVTiers(StepHook):
    def __init__(self, tiers: Sequence[KVTier], kv: KVCacheManager, scheduler: Scheduler,
                 page_template: PackedPages) -> None:  # fmt: skip
        self.tiers = list(tiers)
        self.kv = kv
        self.scheduler = scheduler
        self.layout = PageLayout.of(page_template)
        self.writer = TierWriter(self.tiers)
        self._offered: OrderedDict[BlockHash, None] = OrderedDict()
        self._checked: set[str] = set()  # requests whose tiers were looked up already
        # Lookups under way, by request; their requests are held by the scheduler until their
        # blocks are in the prefix cache (or none came).
        self._lookups: dict[str, Lookup] = {}
        # Lookups that ended with blocks found, to land in the next step (extend).
        self._found: dict[str, tuple[Lookup, list[memoryview]]] = {}
        self._landing: dict[str, Fetch] = {}  # blocks landing in the current step, by writer id
        self._exporting: list[BlockHash] = []  # the block keys of the current step's export
        # Daemon threads: a call stuck for good must not keep the engine process from exiting.
        self._reader = DaemonPool(MAX_READERS, "kv-tier-read")
        self.num_fetched_pages = 0
        self.num_abandoned_lookups = 0  # given up while stuck in a tier call
        self.num_skipped_lookups = 0  # not started: every reader was inside a tier call
        # Lookups not ended yet, abandoned ones too (for close): the reader threads remove theirs.
        self._submitted: set[Future[list[memoryview]]] = set()
        self._submitted_lock = threading.Lock()
        kv.record_evictions()

    # ---- the hook (engine/hooks.py) ------------------------------------------------------------
    def before_schedule(self) -> None:
        """Land what ended, and look up the waiting requests the step could admit."""
        scheduler = self.scheduler
        num_slots = scheduler.config.max_num_seqs - len(scheduler.running)
        self.fetch_for(scheduler.waiting, num_slots, bool(scheduler.running))

    def extend(self, step: SchedulerOutput) -> SchedulerOutput:
        """The step plus the found blocks to land and the pages to send down (those freed or
        evicted since the last step, the landings' own allocations included)."""
        self._settle(dict.fromkeys(self._landing, "the step did not run"))
        for key in self._exporting:  # ... nor was anything exported: offer those blocks again
            self._offered.pop(key, None)
        self._exporting = []
        landings = [landing for found in list(self._found.values())
                    if (landing := self._landing_of(*found)) is not None]  # fmt: skip
        self._found.clear()
        exports = self._export()
        if not landings and not exports:
            return step
        return dataclasses.replace(
            step,
            tag_updates=[*step.tag_updates, *self.kv.drain_tag_updates()],  # the landings' pages
            kv_landings=[*step.kv_landings, *landings],
            kv_exports=[*step.kv_exports, *exports],
        )

    def after_step(self, record: StepRecord) -> None:
        """Index the blocks that landed, and queue what the step exported for the tiers."""
        output = record.output
        self._settle(output.errors)
        packed = output.exported.get(EXPORT_ID)
        keys, self._exporting = self._exporting, []
        if packed is not None and keys:
            self._write(keys, packed)

    def request_ended(self, request_id: str) -> None:
        """The request ended (or was aborted): drop its lookup, if one is under way."""
        self._checked.discard(request_id)
        self._found.pop(request_id, None)
        lookup = self._lookups.pop(request_id, None)
        if lookup is not None:
            lookup.future.cancel()
            self.scheduler.end_fetch(request_id)

    # ---- down: write-back ----------------------------------------------------------------------
    def _export(self) -> list[KVExport]:
        """The cached pages freed or evicted since the last call (and not sent down yet), to
        copy out in this step."""
        evicted = [(p, h) for p, h in self.kv.drain_evicted() if h not in self._offered]
        if not evicted:
            return []
        self._exporting = [block_hash for _, block_hash in evicted]
        for key in self._exporting:
            self._remember(key)
        return [KVExport(EXPORT_ID, [page_id for page_id, _ in evicted])]

    def _write(self, keys: list[BlockHash], packed: PackedPages) -> None:
        layout = self.layout

        def job() -> Iterator[tuple[bytes, memoryview]]:
            for key, payload in zip(keys, layout.split(packed), strict=True):
                yield key, memoryview(payload)

        self.writer.submit(job)

    # ---- up: fetch -----------------------------------------------------------------------------
    def fetch_for(self, waiting: Sequence[Request], max_requests: int, overlap: bool) -> None:
        """Take in the lookups that ended, and start them for the first `max_requests` waiting
        requests (each looked up once). `overlap`: the engine has a step to run meanwhile; if
        not, wait up to IDLE_WAIT_S for a lookup to end rather than spin on held requests
        (never longer: a request that arrives meanwhile is not to wait on a tier)."""
        self._take_ended()
        # Held requests are passed over by admission, so they do not use up the slots either.
        fetching = self.scheduler.fetching
        candidates = (r for r in waiting if r.request_id not in fetching)
        for request in list(itertools.islice(candidates, max_requests)):
            if request.num_computed_tokens or request.request_id in self._checked:
                continue
            self._checked.add(request.request_id)
            self._start_lookup(request)
        if not overlap and self._lookups:
            futures = [lookup.future for lookup in self._lookups.values()]
            wait(futures, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
            self._take_ended()

    def _start_lookup(self, request: Request) -> None:
        hit_pages, wanted = self._wanted(request)
        if wanted and self._reader.num_idle == 0:
            # Every reader is inside a call (a hung tier): a lookup queued behind them would
            # hold its request until its deadline passed unstarted. It computes its prefix.
            self.num_skipped_lookups += 1
            return
        if wanted:
            deadline = time.monotonic() + LOOKUP_DEADLINE_S
            future = self._reader.submit(self._lookup, wanted, deadline)
            with self._submitted_lock:
                self._submitted.add(future)
            future.add_done_callback(self._lookup_done)
            self._lookups[request.request_id] = Lookup(
                request, len(hit_pages), wanted, future, deadline
            )
            self.scheduler.hold_for_fetch(request.request_id)

    def _lookup_done(self, future: Future[list[memoryview]]) -> None:
        with self._submitted_lock:
            self._submitted.discard(future)

    def _wanted(self, request: Request) -> tuple[list[int], list[BlockHash]]:
        """(the device hit's pages, the block keys after it that fit in the pool now)."""
        hashes = self.kv.prefix_hashes(request)
        hit_pages = list(self.kv.find_prefix(request).page_ids)
        wanted = hashes[len(hit_pages) :]
        room = self.kv.num_free_pages - sum(1 for p in hit_pages if self.kv.is_free(p))
        room -= self.kv.num_pages_for(request.num_tokens) - len(hit_pages) - len(wanted)
        return hit_pages, wanted[: max(room, 0)]

    def _take_ended(self) -> None:
        """Keep what every ended lookup found for the next step to land (its request stays
        held until then); give up those stuck in a tier call (their requests compute their
        prefix)."""
        for request_id, lookup in list(self._lookups.items()):
            if lookup.is_stuck:
                self._end_lookup(request_id)
                self._abandon(lookup)
            elif lookup.future.done():
                del self._lookups[request_id]
                found = self._result(lookup)
                if found:
                    self._found[request_id] = (lookup, found)
                else:
                    self.scheduler.end_fetch(request_id)

    def _end_lookup(self, request_id: str) -> None:
        del self._lookups[request_id]
        self.scheduler.end_fetch(request_id)

    def _abandon(self, lookup: Lookup) -> None:
        lookup.future.cancel()  # (no effect once it runs: the reader thread ends it)
        self.num_abandoned_lookups += 1
        logger.warning("KV tier lookup for request %s still inside a tier call %.1f s after its "
                       "deadline; computing its prefix instead (abandoned lookups so far: %d)",
                       lookup.request.request_id, ABANDON_GRACE_S,
                       self.num_abandoned_lookups)  # fmt: skip

    def _result(self, lookup: Lookup) -> list[memoryview]:
        try:
            found = lookup.future.result()
        except Exception:  # a tier's bug: a miss, never a failed request
            logger.exception("KV tier lookup failed; computing the prefix instead")
            return []
        if len(found) < len(lookup.keys):
            # Sent down once but not there now (a tier's LRU, a store restarted, a deadline):
            # offer the rest of the chain again when the device frees it.
            for lost in lookup.keys[len(found) :]:
                self._offered.pop(lost, None)
        return found

    def _landing_of(self, lookup: Lookup, found: list[memoryview]) -> KVLanding | None:
        """What a lookup found, as far as it still continues the request's device hit (the
        pool moved on while the lookup ran) and fits, as a landing in fresh pages; None (the
        request let go) if nothing lands."""
        request_id = lookup.request.request_id
        hit_pages, wanted = self._wanted(lookup.request)
        skip = len(hit_pages) - lookup.start
        count = min(len(found) - skip, len(wanted))
        # Hit pages are held while the fetch's pages are allocated: not evicted for them.
        hit_tags = self.kv.hold(hit_pages) if skip >= 0 and count > 0 else None
        allocated = None if hit_tags is None else self.kv.allocate_for_fetch(count)
        if hit_tags is not None:
            self.kv.release("kv-tier-fetch", hit_pages[::-1], hit_tags[::-1])
        if allocated is None:  # the device lost part of the hit meanwhile, or no room
            self.scheduler.end_fetch(request_id)
            return None
        page_ids, tags = allocated
        writer_id = f"{FETCH_WRITER}:{request_id}"
        self._landing[writer_id] = Fetch(request_id, lookup.keys[skip:][:count], page_ids, tags)
        pages = self.layout.join(found[skip:][:count])
        return KVLanding(writer_id, page_ids, tags, pages)

    def _settle(self, failed: Mapping[str, str]) -> None:
        """Index the blocks of the step's landings that the runner wrote (those in `failed`, by
        writer id, did not land: they are computed instead), free their pages, and let their
        requests go."""
        for writer_id, fetch in self._landing.items():
            keep = 0 if writer_id in failed else len(fetch.page_ids)
            if keep == 0:
                logger.warning("KV tier blocks could not land (%s); computing them instead",
                               failed[writer_id])  # fmt: skip
            for violation in self.kv.adopt_fetched(fetch.page_ids, fetch.tags, fetch.keys, keep):
                logger.error("KV tier fetch: %s", violation.message)
            for key in fetch.keys[:keep]:
                self._remember(key)
            self.num_fetched_pages += keep
            self.scheduler.end_fetch(fetch.request_id)
        self._landing.clear()

    def _lookup(self, keys: Sequence[BlockHash], deadline: float) -> list[memoryview]:
        """Payloads of the leading keys found in some tier (first tier wins), in order, as far
        as the deadline lets it go. Runs on a reader thread: touches only the tiers."""
        found: list[memoryview] = []
        for key in keys:
            payload = self._first_hit(key, deadline)
            if payload is None or len(payload) != self.layout.payload_bytes:
                break
            found.append(payload)
        return found

    def _first_hit(self, key: BlockHash, deadline: float) -> memoryview | None:
        for tier in self.tiers:
            if time.monotonic() >= deadline:
                return None
            started = time.perf_counter()
            payload = tier.get(key)
            _count_fetch(tier, time.perf_counter() - started)
            if payload is not None:
                return payload
        return None

    # ---- the rest ------------------------------------------------------------------------------
    def _remember(self, key: BlockHash) -> None:
        self._offered[key] = None
        self._offered.move_to_end(key)
        if len(self._offered) > MAX_OFFERED_KEYS:
            self._offered.popitem(last=False)

    def stats(self) -> dict[str, dict[str, float]]:
        out = {tier.name: tier.counters.as_dict() for tier in self.tiers}
        for counters in out.values():  # the engine's own, shown with every tier
            counters["dropped_write_jobs"] = self.writer.num_dropped_jobs
            counters["abandoned_lookups"] = self.num_abandoned_lookups
            counters["skipped_lookups"] = self.num_skipped_lookups
        return out

    @property
    def shared_store_id(self) -> str:
        """The shared tier's store id (SharedTier.store_id), '' without one."""
        return next((t.store_id for t in self.tiers if isinstance(t, SharedTier)), "")

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        """Stop reading and writing, then close the tiers, unless a reader is still inside a
        tier call after CLOSE_WAIT_S (a hung file system): its tier is then left open, since
        closing a directory descriptor under a running read could let it read another file."""
        self._settle(dict.fromkeys(self._landing, "the tiers closed"))
        for request_id in [*self._lookups, *self._found]:
            self.request_ended(request_id)
        self._reader.shutdown()
        with self._submitted_lock:
            submitted = list(self._submitted)
        _, stuck = wait(submitted, timeout=CLOSE_WAIT_S)
        self.writer.close()
        if stuck:
            logger.warning("KV tiers closed with %d lookups still inside a tier call; the "
                           "tiers are left open for them", len(stuck))  # fmt: skip
            return
        for tier in self.tiers:
            tier.close()


def _count_fetch(tier: KVTier, seconds: float) -> None:
    with tier.counters._lock:
        tier.counters.fetch_seconds += seconds
        tier.counters.num_fetches += 1
