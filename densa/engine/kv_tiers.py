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
                                    stepping the running requests; the request is held (not
                                    admitted, and the queue behind it waits, as for room) until
                                    the lookup ends. Then, on the engine thread, found blocks
                                    land in freshly allocated pages (kv_io.land), are indexed
                                    under their block hash and freed, so admission hits them
                                    like any cached page. With nothing running there is nothing
                                    to overlap: the engine waits for the lookup instead.

Page bytes are kv_io's (PackedPages): values [L, parts, n, H, P, D] then row scales
[L, parts, n, H, P]. One page's payload is its slice of every (layer, part) row, in order:

    payload(page i) = values[0, 0, i] | values[0, 1, i] | ... | values[L-1, parts-1, i]
                      | scales[0, 0, i] | ... | scales[L-1, parts-1, i]
                      | the same of its index keys (sparse attention: PackedPages.index)
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from densa.auth.secret import load_secret
from densa.cache.kv_manager import KVCacheManager
from densa.cache.prefix_index import BlockHash
from densa.cache.tiers.block import BlockCodec, fingerprint_of
from densa.cache.tiers.disk import DiskTier
from densa.cache.tiers.host import HostTier
from densa.cache.tiers.tier import KVTier, TierSpec, logger, parse_tier_spec
from densa.cache.tiers.writer import TierWriter
from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig
from densa.request import Request
from densa.sched.output import PackedPages
from densa.worker import kv_io
from densa.worker.model_runner import ModelRunner

MAX_OFFERED_KEYS = 1 << 17  # blocks remembered as already sent down (skips re-copying a prefix)
TIER_KEY_PURPOSE = "kv-tier"  # ClusterSecret.key(...) for the shared tier's MAC


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
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-read")
        self.num_fetched_pages = 0
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
        not, wait for the lookups here instead of spinning on held requests."""
        self._land_ended(wait=False)
        for request in list(waiting)[:max_requests]:
            if request.num_computed_tokens or request.request_id in self._checked:
                continue
            self._checked.add(request.request_id)
            self._start_lookup(request)
        if not overlap:
            self._land_ended(wait=True)

    def forget(self, request_id: str) -> None:
        """The request ended (or was aborted): drop its lookup, if one is under way."""
        self._checked.discard(request_id)
        lookup = self._lookups.pop(request_id, None)
        if lookup is not None:
            lookup.future.cancel()
            self.fetching.discard(request_id)

    def _start_lookup(self, request: Request) -> None:
        hit_pages, wanted = self._wanted(request)
        if wanted:
            future = self._reader.submit(self._lookup, wanted)
            self._lookups[request.request_id] = Lookup(request, len(hit_pages), wanted, future)
            self.fetching.add(request.request_id)

    def _wanted(self, request: Request) -> tuple[list[int], list[BlockHash]]:
        """(the device hit's pages, the block keys after it that fit in the pool now)."""
        hashes = self.kv.prefix_hashes(request)
        hit_pages = list(self.kv.find_prefix(request).page_ids)
        wanted = hashes[len(hit_pages) :]
        room = self.kv.num_free_pages - sum(1 for p in hit_pages if self.kv.pool.is_free(p))
        room -= self.kv.num_pages_for(request.num_tokens) - len(hit_pages) - len(wanted)
        return hit_pages, wanted[: max(room, 0)]

    def _land_ended(self, wait: bool) -> None:
        """Land every lookup that has ended (all of them, waiting for each, if `wait`)."""
        for request_id, lookup in list(self._lookups.items()):
            if not wait and not lookup.future.done():
                continue
            del self._lookups[request_id]
            self.fetching.discard(request_id)
            try:
                found = lookup.future.result()
            except Exception:  # a tier's bug: a miss, never a failed request
                logger.exception("KV tier lookup failed; computing the prefix instead")
                continue
            if len(found) < len(lookup.keys):
                # Sent down once but not there now (a tier's LRU, a store restarted): offer the
                # rest of the chain again when the device frees it.
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

    def _lookup(self, keys: Sequence[BlockHash]) -> list[memoryview]:
        """Payloads of the leading keys found in some tier (first tier wins), in order. Runs
        on the reader thread: touches only the tiers."""
        found: list[memoryview] = []
        for key in keys:
            payload = None
            for tier in self.tiers:
                started = time.perf_counter()
                payload = tier.get(key)
                _count_fetch(tier, time.perf_counter() - started)
                if payload is not None:
                    break
            if payload is None or len(payload) != self.layout.payload_bytes:
                break
            found.append(payload)
        return found

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
        for counters in out.values():
            counters["dropped_write_jobs"] = self.writer.num_dropped_jobs
        return out

    @property
    def shared_store_id(self) -> str:
        """The shared tier's store id (SharedTier.store_id), '' without one."""
        # Duck-typed: importing shared.py imports the Redis client, which only its users need.
        return next((t.store_id for t in self.tiers if hasattr(t, "store_id")), "")

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        for request_id in list(self._lookups):
            self.forget(request_id)
        self._reader.shutdown(wait=True)
        self.writer.close()
        for tier in self.tiers:
            tier.close()


def build_tiers(specs: Sequence[str], fingerprint: bytes, secret_file: str | None) -> list[KVTier]:
    """The tiers `--kv-tier` names, in the order given."""
    tiers: list[KVTier] = []
    for spec in map(parse_tier_spec, specs):
        tiers.append(_build_one(spec, fingerprint, secret_file))
    return tiers


def _build_one(spec: TierSpec, fingerprint: bytes, secret_file: str | None) -> KVTier:
    if spec.kind == "disk":
        return DiskTier(spec.path, spec.size_bytes, BlockCodec(fingerprint))
    if spec.kind == "host":
        return HostTier(spec.size_bytes, BlockCodec(fingerprint))
    from densa.cache.tiers.shared import SharedTier  # imports the redis client only when used

    secret = load_secret(secret_file)
    if secret is None:
        raise ValueError(
            "--kv-tier shared:... needs the cluster secret (--cluster-secret-file or "
            "DENSA_CLUSTER_SECRET): every value in the shared store is sealed with it"
        )
    return SharedTier(spec.url, BlockCodec(fingerprint, secret.key(TIER_KEY_PURPOSE)))


def engine_fingerprint(model_path: str, weight_format: str, kv_format: str, page: PackedPages,
                       arch: ArchConfig, key_encoding: str) -> bytes:  # fmt: skip
    """What must match for a stored page to be this engine's: the model file (by name and
    size, so two machines with the same file agree), its weight format, the KV format with its
    static scales and how it holds K (centered or not), the page geometry and architecture."""
    path = Path(model_path)
    size = path.stat().st_size if path.is_file() else 0
    architecture = repr(sorted(arch.signature().items()))
    return fingerprint_of(path.name, str(size), weight_format, kv_format, page.kv_dtype,
                          page.kv_scales, repr(page.static_scales), repr(page.shape[:2]),
                          repr(page.shape[3:]), architecture, key_encoding)  # fmt: skip


def _count_fetch(tier: KVTier, seconds: float) -> None:
    with tier.counters._lock:
        tier.counters.fetch_seconds += seconds
        tier.counters.num_fetches += 1
