"""The engine's side of the KV tiers (densa/cache/tiers): pages go down when freed, and come back
up when a waiting request's prefix misses the device pool but a tier holds it.

    after anything frees or         cached full pages that became free (a request ended or was
    allocates pages (schedule,      preempted) or were evicted, and were not sent down before,
    a fetch, a KV transfer's        are copied out of the device (worker/kv_io.pack, one call)
    reservation, an abort)          before the step (or the fetch's landing) can write them;
                                    the background writer splits, seals and stores them in
                                    every tier. Sending at free time, not only at eviction,
                                    lets another worker fetch a session's history while this
                                    one still holds it.
    before schedule()               for the waiting requests that could be admitted next: the
                                    blocks after their device hit are looked up tier by tier
                                    (first tier that verifies wins, the chain stops at the first
                                    block no tier has) on a reader thread, while the engine keeps
                                    stepping; the request is held (not admitted) until the
                                    lookup ends, and the requests behind it are admitted
                                    meanwhile. Then, on the engine thread, found blocks land in
                                    freshly allocated pages (kv_io.land), are indexed under their
                                    block hash and freed, so admission hits them like any cached
                                    page.

A slow tier costs only the request that asked: the engine thread never waits on a lookup for
longer than IDLE_WAIT_S (and only with nothing else to run); a lookup starts no tier call after
its deadline (LOOKUP_DEADLINE_S: what it found by then lands), and one stuck inside a call past
that (a store that drips its answer, a hung network file system) is given up ABANDON_GRACE_S
later: the request computes its prefix. Lookups run on MAX_READERS threads, so one stuck call
does not queue every other request's lookup behind it.

Page bytes are kv_io's (PackedPages): values [L, parts, n, H, P, D] then row scales
[L, parts, n, H, P]. One page's payload is its slice of every (layer, part) row, in order:

    payload(page i) = values[0, 0, i] | values[0, 1, i] | ... | values[L-1, parts-1, i]
                      | scales[0, 0, i] | ... | scales[L-1, parts-1, i]
                      | the same of its index keys (sparse attention: PackedPages.index)
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from densa.cache.kv_manager import KVCacheManager
from densa.cache.prefix_index import BlockHash
from densa.cache.tiers.shared import SharedTier
from densa.cache.tiers.tier import KVTier, logger
from densa.cache.tiers.writer import TierWriter
from densa.formats.kv_format import KVFormat
from densa.request import Request
from densa.sched.output import PackedPages
from densa.utils.daemon_pool import DaemonPool
from densa.worker import kv_io
from densa.worker.model_runner import ModelRunner

MAX_OFFERED_KEYS = 1 << 17  # blocks remembered as already sent down (skips re-copying a prefix)
MAX_READERS = 4  # lookups at once: a call stuck on one tier holds one reader, not all lookups
# A lookup starts no tier call after this long: what it found by then lands, the rest is
# computed (a prefix that takes longer to read than this is not worth holding a request for).
LOOKUP_DEADLINE_S = 2.0
ABANDON_GRACE_S = 0.5  # past the deadline by this much, a lookup stuck in a call is given up
IDLE_WAIT_S = 0.01  # nothing to run: how long a step waits for a lookup before it returns
CLOSE_WAIT_S = 5.0  # closing: how long to wait for readers still inside a tier call


@dataclass(frozen=True)
class PageLayout:
    """How one page's bytes sit in a PackedPages of n pages (see the module docstring)."""

    num_rows: int  # layers x parts
    value_bytes: int  # one page's values in one (layer, part) row
    scale_bytes: int  # one page's row scales in one (layer, part) row (0: none)
    template: PackedPages  # a 0-page pack: the format, scales and shape to rebuild
    index: PageLayout | None = None  # sparse attention's index keys, after the pages' own bytes

    @property
    def own_bytes(self) -> int:
        return self.num_rows * (self.value_bytes + self.scale_bytes)

    @property
    def payload_bytes(self) -> int:
        return self.own_bytes + (0 if self.index is None else self.index.payload_bytes)

    def split(self, pages: PackedPages) -> list[bytes]:
        own = self._split_own(pages)
        if self.index is None or pages.index is None:
            return own
        return [a + b for a, b in zip(own, self.index.split(pages.index), strict=True)]

    def _split_own(self, pages: PackedPages) -> list[bytes]:
        n = pages.shape[2]
        values, scales = memoryview(pages.values), pages.row_scales
        payloads = []
        for i in range(n):
            parts = [values[(r * n + i) * self.value_bytes :][: self.value_bytes]
                     for r in range(self.num_rows)]  # fmt: skip
            if scales is not None:
                parts += [scales[(r * n + i) * self.scale_bytes :][: self.scale_bytes]
                          for r in range(self.num_rows)]  # fmt: skip
            payloads.append(b"".join(parts))
        return payloads

    def join(self, payloads: Sequence[memoryview]) -> PackedPages:
        rows = range(self.num_rows)
        values = b"".join(p[r * self.value_bytes :][: self.value_bytes] for r in rows
                          for p in payloads)  # fmt: skip
        scales = None
        if self.scale_bytes:
            base = self.num_rows * self.value_bytes
            scales = memoryview(b"".join(p[base + r * self.scale_bytes :][: self.scale_bytes]
                                         for r in rows for p in payloads))  # fmt: skip
        shape = list(self.template.shape)
        shape[2] = len(payloads)
        index = None
        if self.index is not None:
            index = self.index.join([p[self.own_bytes :] for p in payloads])
        return PackedPages(self.template.kv_dtype, self.template.kv_scales, tuple(shape),
                           memoryview(values), scales, self.template.static_scales,
                           index)  # fmt: skip

    @classmethod
    def of(cls, template: PackedPages) -> PageLayout:
        num_layers, num_parts, _, heads, page_size, head_dim = template.shape
        kv_format = KVFormat(template.kv_dtype, template.kv_scales)
        itemsize = kv_format.storage_dtype.itemsize
        scale_dtype = kv_format.row_scale_dtype
        scale_itemsize = 0 if scale_dtype is None else scale_dtype.itemsize
        index = None if template.index is None else cls.of(template.index)
        return cls(num_layers * num_parts, heads * page_size * head_dim * itemsize,
                   heads * page_size * scale_itemsize, template, index)  # fmt: skip


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


class KVTiers:
    def __init__(self, tiers: Sequence[KVTier], kv: KVCacheManager, runner: ModelRunner,
                 fetching: set[str]) -> None:  # fmt: skip
        self.tiers = list(tiers)
        self.kv = kv
        self.runner = runner
        self.layout = PageLayout.of(kv_io.pack(runner.kv_caches, []))
        self.writer = TierWriter(self.tiers)
        self._offered: OrderedDict[BlockHash, None] = OrderedDict()
        self._checked: set[str] = set()  # requests whose tiers were looked up already
        # Lookups under way, by request; their requests are in `fetching` (the scheduler's set of
        # waiting requests it must not admit yet) until they land.
        self._lookups: dict[str, Lookup] = {}
        self.fetching = fetching
        # Daemon threads: a call stuck for good must not keep the engine process from exiting.
        self._reader = DaemonPool(MAX_READERS, "kv-tier-read")
        self.num_fetched_pages = 0
        self.num_abandoned_lookups = 0  # given up while stuck in a tier call
        self.num_skipped_lookups = 0  # not started: every reader was inside a tier call
        # Lookups not ended yet, abandoned ones too (for close): the reader threads remove theirs.
        self._submitted: set[Future[list[memoryview]]] = set()
        self._submitted_lock = threading.Lock()
        kv.record_evictions()

    # ---- down: write-back ----------------------------------------------------------------------
    def write_back(self) -> None:
        """Copy the cached pages freed or evicted since the last call (and not sent down yet) and
        queue them for the tiers."""
        evicted = [(p, h) for p, h in self.kv.drain_evicted() if h not in self._offered]
        if not evicted:
            return
        page_ids = [page_id for page_id, _ in evicted]
        packed = kv_io.pack(self.runner.kv_caches, page_ids)  # a copy, before the step writes
        keys = [block_hash for _, block_hash in evicted]
        for key in keys:
            self._remember(key)
        layout = self.layout

        def job() -> Iterator[tuple[bytes, memoryview]]:
            for key, payload in zip(keys, layout.split(packed), strict=True):
                yield key, memoryview(payload)

        self.writer.submit(job)

    # ---- up: fetch -----------------------------------------------------------------------------
    def fetch_for(self, waiting: Sequence[Request], max_requests: int, overlap: bool) -> None:
        """Land the lookups that ended, and start them for the first `max_requests` waiting
        requests (each looked up once). `overlap`: the engine has a step to run meanwhile; if
        not, wait up to IDLE_WAIT_S for a lookup to end rather than spin on held requests
        (never longer: a request that arrives meanwhile is not to wait on a tier)."""
        self._land_ended()
        # Held requests are passed over by admission, so they do not use up the slots either.
        candidates = (r for r in waiting if r.request_id not in self.fetching)
        for request in list(itertools.islice(candidates, max_requests)):
            if request.num_computed_tokens or request.request_id in self._checked:
                continue
            self._checked.add(request.request_id)
            self._start_lookup(request)
        if not overlap and self._lookups:
            futures = [lookup.future for lookup in self._lookups.values()]
            wait(futures, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
            self._land_ended()

    def forget(self, request_id: str) -> None:
        """The request ended (or was aborted): drop its lookup, if one is under way."""
        self._checked.discard(request_id)
        lookup = self._lookups.pop(request_id, None)
        if lookup is not None:
            lookup.future.cancel()
            self.fetching.discard(request_id)

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
            self.fetching.add(request.request_id)

    def _lookup_done(self, future: Future[list[memoryview]]) -> None:
        with self._submitted_lock:
            self._submitted.discard(future)

    def _wanted(self, request: Request) -> tuple[list[int], list[BlockHash]]:
        """(the device hit's pages, the block keys after it that fit in the pool now)."""
        hashes = self.kv.prefix_hashes(request)
        hit_pages = list(self.kv.find_prefix(request).page_ids)
        wanted = hashes[len(hit_pages) :]
        room = self.kv.num_free_pages - sum(1 for p in hit_pages if self.kv.pool.is_free(p))
        room -= self.kv.num_pages_for(request.num_tokens) - len(hit_pages) - len(wanted)
        return hit_pages, wanted[: max(room, 0)]

    def _land_ended(self) -> None:
        """Land every lookup that has ended; give up those stuck in a tier call (their requests
        compute their prefix)."""
        for request_id, lookup in list(self._lookups.items()):
            if lookup.is_stuck:
                self._end_lookup(request_id)
                self._abandon(lookup)
            elif lookup.future.done():
                self._end_lookup(request_id)
                self._land_result(lookup)

    def _end_lookup(self, request_id: str) -> None:
        del self._lookups[request_id]
        self.fetching.discard(request_id)

    def _abandon(self, lookup: Lookup) -> None:
        lookup.future.cancel()  # (no effect once it runs: the reader thread ends it)
        self.num_abandoned_lookups += 1
        logger.warning("KV tier lookup for request %s still inside a tier call %.1f s after its "
                       "deadline; computing its prefix instead (abandoned lookups so far: %d)",
                       lookup.request.request_id, ABANDON_GRACE_S,
                       self.num_abandoned_lookups)  # fmt: skip

    def _land_result(self, lookup: Lookup) -> None:
        try:
            found = lookup.future.result()
        except Exception:  # a tier's bug: a miss, never a failed request
            logger.exception("KV tier lookup failed; computing the prefix instead")
            return
        if len(found) < len(lookup.keys):
            # Sent down once but not there now (a tier's LRU, a store restarted, a deadline):
            # offer the rest of the chain again when the device frees it.
            for lost in lookup.keys[len(found) :]:
                self._offered.pop(lost, None)
        self._land_found(lookup, found)

    def _land_found(self, lookup: Lookup, found: list[memoryview]) -> None:
        """Land what a lookup found, as far as it still continues the request's device hit
        (the pool moved on while the lookup ran) and fits."""
        hit_pages, wanted = self._wanted(lookup.request)
        if len(hit_pages) < lookup.start or not wanted:
            return  # the device lost part of the hit meanwhile: the chain no longer joins
        skip = len(hit_pages) - lookup.start
        found, keys = found[skip:], lookup.keys[skip:]
        count = min(len(found), len(wanted))
        if count:
            self._land(hit_pages, keys[:count], found[:count])

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

    def _land(
        self, hit_pages: list[int], keys: list[BlockHash], payloads: list[memoryview]
    ) -> None:
        pool = self.kv.pool
        hit_tags = pool.tags(hit_pages)
        for page_id in hit_pages:  # held while fetched pages are allocated: not evicted for them
            pool.touch(page_id)
        allocated = self.kv.allocate_for_fetch(len(payloads))
        try:
            if allocated is None:
                return
            self.write_back()  # what the allocation evicted, before the landing overwrites it
            page_ids, tags = allocated
            try:
                kv_io.land(self.runner.kv_caches, page_ids, self.layout.join(payloads))
                keep = len(page_ids)
            except kv_io.LandingError as exc:
                logger.warning("KV tier blocks could not land (%s); computing them instead", exc)
                keep = 0
            for violation in self.kv.adopt_fetched(page_ids, tags, keys, keep):
                logger.error("KV tier fetch: %s", violation.message)
            for key in keys[:keep]:
                self._remember(key)
            self.num_fetched_pages += keep
        finally:
            self.kv.release("kv-tier-fetch", hit_pages[::-1], hit_tags[::-1])

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
        for request_id in list(self._lookups):
            self.forget(request_id)
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
