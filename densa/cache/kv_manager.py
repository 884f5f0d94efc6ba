"""Maps requests to KV pages: allocation as they grow, prefix reuse, release on finish/preemption.

The manager mutates only the pool, its prefix index and the `page_ids` / `page_tags` lists of the
requests it is given. "No room" is a normal answer (`None`), not an exception.
"""

from __future__ import annotations

from dataclasses import dataclass

from densa.cache.integrity import IntegrityViolation, ViolationKind
from densa.cache.page_pool import PagePool
from densa.cache.prefix_index import BlockHash, PrefixIndex, hash_block
from densa.request import Request


@dataclass(frozen=True)
class PrefixHit:
    """Pages that already hold a request's leading tokens, and how many tokens they cover."""

    page_ids: tuple[int, ...] = ()

    def num_tokens(self, page_size: int) -> int:
        return len(self.page_ids) * page_size


NO_HIT = PrefixHit()


@dataclass(frozen=True)
class PrefixCacheStats:
    queried_tokens: int
    hit_tokens: int


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self.enable_prefix_caching = enable_prefix_caching
        self._index = PrefixIndex()
        self.pool.set_evict_callback(self._evict)
        # Hashes of each request's full blocks, computed once; kept across preemption (same tokens).
        self._block_hashes: dict[str, list[BlockHash]] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        # KV tiers (engine/kv_tiers.py): cached pages just freed or reallocated, as (page, block
        # hash). Their bytes are intact until the next step writes them; the engine copies them
        # out first (it drains after every allocation, before the step runs). None: not recorded.
        self._evicted: list[tuple[int, BlockHash]] | None = None

    # ---- sizing --------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free_pages

    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- the pool, as the rest of the engine sees it (nobody else reaches into it) --------------
    def drain_tag_updates(self) -> list[tuple[int, int]]:
        """(page, tag) for every tag change since the last call: a step carries them to the
        runner's tag table (SchedulerOutput.tag_updates)."""
        return self.pool.drain_tag_updates()

    def check_consistency(self, owners: dict[str, list[int]]) -> None:
        """Assert every page's reference count is the number of owners mapping it (tests)."""
        self.pool.check_consistency(owners)

    def is_free(self, page_id: int) -> bool:
        """In a free queue (a cached page may be, until it is reused)."""
        return self.pool.is_free(page_id)

    def hold(self, page_ids: list[int]) -> list[int]:
        """One more reference on each page (a free one leaves the free queue, so no allocation
        evicts it); their tags, to `release` them with."""
        for page_id in page_ids:
            self.pool.touch(page_id)
        return self.pool.tags(page_ids)

    # ---- prefix reuse --------------------------------------------------------------------------
    def find_prefix(self, request: Request) -> PrefixHit:
        """Longest run of leading full blocks already cached in the request's scope (no mutation).

        At least one token is always left to compute, since the next token needs its logits; a
        request that needs its prompt's logits (`needs_prompt_logits`) gets no hit at all.
        """
        if not self.enable_prefix_caching or request.needs_prompt_logits:
            return NO_HIT
        max_blocks = (request.num_tokens - 1) // self.page_size
        page_ids: list[int] = []
        for block_hash in self._hashes(request)[:max_blocks]:
            page_id = self._index.lookup(block_hash)
            if page_id is None:
                break
            page_ids.append(page_id)
        return PrefixHit(tuple(page_ids))

    def prefix_hashes(self, request: Request) -> list[BlockHash]:
        """Block hashes of the leading full blocks a prefix hit may cover (one token is always
        left to compute; none for a request that needs its prompt's logits)."""
        if not self.enable_prefix_caching or request.needs_prompt_logits:
            return []
        return self._hashes(request)[: (request.num_tokens - 1) // self.page_size]

    def record_prefix_query(self, request: Request, hit: PrefixHit) -> None:
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += hit.num_tokens(self.page_size)

    def cache_full_pages(self, request: Request) -> None:
        """Index the request's pages whose every token has been computed (call after a step)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.page_size, len(request.page_ids))
        hashes = self._hashes(request)
        for block_idx in range(num_full):
            self._index.insert(hashes[block_idx], request.page_ids[block_idx])

    # ---- allocation ----------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT
    ) -> list[int] | None:
        """Make the request's pages cover its computed tokens + hit + num_new_tokens.

        Returns the newly allocated page ids (possibly empty), or None, changing nothing, when the
        pool cannot supply them. Hit pages are mapped first and keep their current tags.
        """
        num_tokens_after = request.num_computed_tokens + hit.num_tokens(self.page_size)
        num_tokens_after += num_new_tokens
        num_mapped = len(request.page_ids) + len(hit.page_ids)
        num_needed = max(0, self.num_pages_for(num_tokens_after) - num_mapped)
        # Hit pages that sit in the free queue are taken out of it, so they count against free room.
        num_revived = sum(1 for page_id in hit.page_ids if self.pool.is_free(page_id))
        if num_needed + num_revived > self.pool.num_free_pages:
            return None
        for page_id in hit.page_ids:
            self.pool.touch(page_id)
            request.page_ids.append(page_id)
            request.page_tags.append(self.pool.tag(page_id))
        new_page_ids = self.pool.allocate(num_needed)
        assert new_page_ids is not None  # room was checked above
        request.page_ids.extend(new_page_ids)
        request.page_tags.extend(self.pool.tags(new_page_ids))
        return new_page_ids

    def free(self, request: Request) -> list[IntegrityViolation]:
        """Release every page the request maps, tail first (so tail pages are evicted first).

        Cached prefix pages of a session (x-session-affinity) are kept longer than anyone else's:
        the next turn of the conversation will want them.
        """
        problems = self.release(
            request.request_id,
            request.page_ids[::-1],
            request.page_tags[::-1],
            protect=request.session_id is not None,
        )
        request.page_ids.clear()
        request.page_tags.clear()
        return problems

    def truncate(self, request: Request, num_tokens: int) -> list[IntegrityViolation]:
        """Release the request's pages wholly beyond its first num_tokens tokens, tail first
        (speculative decoding's rollback of rejected tokens). Their tags change as any freed
        page's do, so a reader that still maps them is caught; a partly used last page keeps
        its stale slots, which the next tokens overwrite before the page is ever full."""
        num_kept = self.num_pages_for(num_tokens)
        if len(request.page_ids) <= num_kept:
            return []
        problems = self.release(
            request.request_id,
            request.page_ids[num_kept:][::-1],
            request.page_tags[num_kept:][::-1],
        )
        del request.page_ids[num_kept:], request.page_tags[num_kept:]
        request.num_pages_sent = min(request.num_pages_sent, num_kept)  # re-grant those indexes
        return problems

    def release(
        self, owner_id: str, page_ids: list[int], tags: list[int], protect: bool = False
    ) -> list[IntegrityViolation]:
        """Drop one reference per (page, tag) -- only where the tag still matches.

        A mismatch means the reference was already dropped (the page was released since, and
        maybe reused) or never belonged to this page: releasing it would free someone else's page,
        so it is refused and reported instead.
        """
        problems = []
        for page_id, tag in zip(page_ids, tags, strict=True):
            found = self.pool.tag(page_id)
            if found == tag and self.pool.ref_count(page_id) > 0:
                self._free_page(page_id, protect)
                continue
            wrong_page = self.pool.page_of_tag(tag) != page_id
            kind = ViolationKind.BAD_MAPPING if wrong_page else ViolationKind.DOUBLE_FREE
            problems.append(IntegrityViolation(owner_id, kind, page_id, tag, found))
        return problems

    def _free_page(self, page_id: int, protect: bool) -> None:
        cached = self._index.has_page(page_id)
        self.pool.free([page_id], protect=protect and cached)
        if cached and self._evicted is not None and self.pool.is_free(page_id):
            # Sent down as soon as no one holds it (another worker may want it before this
            # pool evicts it); the engine skips blocks it already sent.
            block_hash = self._index.hash_of(page_id)
            assert block_hash is not None
            self._evicted.append((page_id, block_hash))
        if not cached and self.pool.is_free(page_id):
            self.pool.move_to_front(page_id)  # holds nothing reusable: reuse it before cached ones

    def check_writer(
        self, writer_id: str, request: Request | None, page_ids: list[int], tags: list[int]
    ) -> IntegrityViolation | None:
        """May this writer land data on these pages? Only if it still maps each page with the tag
        it was issued and is the page's only owner: a shared prefix page is immutable, and a tag
        alone cannot tell its owners apart."""
        owned = dict(zip(request.page_ids, request.page_tags, strict=True)) if request else {}
        for page_id, tag in zip(page_ids, tags, strict=True):
            found = self.pool.tag(page_id)
            if owned.get(page_id) != tag or found != tag or self.pool.ref_count(page_id) != 1:
                wrong_page = self.pool.page_of_tag(tag) != page_id
                kind = ViolationKind.BAD_MAPPING if wrong_page else ViolationKind.STALE_WRITE
                return IntegrityViolation(writer_id, kind, page_id, tag, found)
        return None

    def precompute(self, request: Request) -> None:
        """Hash the request's full prompt blocks now, at admission (see LLMEngine.add_request):
        a request whose tokens or scope cannot be hashed is refused before it is scheduled."""
        self._hashes(request)

    def forget(self, request: Request) -> None:
        """Drop per-request state once the request is finished (its pages must already be freed)."""
        self._block_hashes.pop(request.request_id, None)

    # ---- KV tiers (engine/kv_tiers.py drives these) --------------------------------------------
    def record_evictions(self) -> None:
        """From now on, remember cached pages as they are freed and reallocated (see
        drain_evicted)."""
        if self._evicted is None:
            self._evicted = []

    def stop_recording_evictions(self) -> None:
        self._evicted = None

    def drain_evicted(self) -> list[tuple[int, BlockHash]]:
        """(page, block hash) of cached pages freed or reallocated since the last call, oldest
        first. Their bytes are intact until the next step (or fetch) writes the pages."""
        if not self._evicted:
            return []
        evicted, self._evicted = self._evicted, []
        return evicted

    def _evict(self, page_id: int) -> None:
        block_hash = self._index.hash_of(page_id)
        if self._index.evict(page_id) and block_hash is not None and self._evicted is not None:
            self._evicted.append((page_id, block_hash))

    def allocate_for_fetch(self, num_pages: int) -> tuple[list[int], list[int]] | None:
        """Fresh pages (ref 1, new tags) for blocks fetched from a tier, or None (no room
        without evicting cached pages a waiting request may want)."""
        if num_pages > self.pool.num_free_pages:
            return None
        page_ids = self.pool.allocate(num_pages)
        assert page_ids is not None
        return page_ids, self.pool.tags(page_ids)

    def adopt_fetched(
        self, page_ids: list[int], tags: list[int], hashes: list[BlockHash], keep: int
    ) -> list[IntegrityViolation]:
        """The fetched bytes landed in `page_ids`: index the first `keep` pages under their
        block hashes, then drop the fetch's reference (the pages stay cached, free, at the back
        of the queue, for the request's admission to hit). The writer's tags are checked first;
        a page that is not the writer's alone any more is not indexed."""
        problems = []
        for idx, (page_id, tag) in enumerate(zip(page_ids, tags, strict=True)):
            if self.pool.tag(page_id) != tag or self.pool.ref_count(page_id) != 1:
                kind = ViolationKind.STALE_WRITE
                problems.append(IntegrityViolation("kv-tier-fetch", kind, page_id, tag,
                                                   self.pool.tag(page_id)))  # fmt: skip
                continue
            if idx < keep:
                self._index.insert(hashes[idx], page_id)
        return problems + self.release("kv-tier-fetch", page_ids[::-1], tags[::-1])

    def reset_prefix_cache(self) -> None:
        self._index.clear()

    def reset_counters(self) -> None:
        """Start the prefix-cache counters from zero (after a warm-up)."""
        self.num_queried_tokens = self.num_hit_tokens = 0

    @property
    def num_cached_pages(self) -> int:
        return len(self._index)

    # ---- internals -----------------------------------------------------------------------------
    def _hashes(self, request: Request) -> list[BlockHash]:
        """Block hashes of the request's full blocks, extended lazily as it generates tokens."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.page_size
        while len(hashes) < num_full:
            start = len(hashes) * self.page_size
            tokens = request.token_slice(start, start + self.page_size)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens, request.cache_scope))
        return hashes
