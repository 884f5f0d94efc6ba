"""The physical KV page pool: which pages are free, who references them, and their generation tags.

Pages are integers 0..num_pages-1. The KV tensors themselves live in the worker; this module never
touches them. Every page is in exactly one of two states:

    owned   ref_count > 0, not in the free queue
    free    ref_count == 0, in the free queue (oldest first = next to be reused). A free page may still
            hold a reusable prefix (it keeps its hash) until it is reallocated, which evicts the hash.

Each (re)allocation increments the page's generation tag, so a stale mapping (page id + old tag) can
always be told apart from the page's current owner. Reviving a cached free page for a prefix hit
(`touch`) is not a reallocation: the content is unchanged, so the tag stays.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable


class PagePoolError(RuntimeError):
    """A bookkeeping bug (double free, freeing an unowned page). Never a normal "pool is full"."""


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("the page pool needs at least one page")
        self.num_pages = num_pages
        self._ref_counts = [0] * num_pages
        self._tags = [0] * num_pages
        # Insertion order is eviction order: allocate() takes from the front.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        # Called with a page id when a free page that still held cached content is reallocated.
        self._on_evict: Callable[[int], None] | None = None

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def ref_count(self, page_id: int) -> int:
        return self._ref_counts[page_id]

    def tag(self, page_id: int) -> int:
        return self._tags[page_id]

    def tags(self, page_ids: Iterable[int]) -> list[int]:
        return [self._tags[p] for p in page_ids]

    def is_free(self, page_id: int) -> bool:
        return page_id in self._free

    # ---- mutations -----------------------------------------------------------------------------
    def set_evict_callback(self, callback: Callable[[int], None]) -> None:
        self._on_evict = callback

    def allocate(self, num_pages: int) -> list[int] | None:
        """Take `num_pages` free pages (ref 1, new tag each). None, and nothing changed, if too few."""
        if num_pages > len(self._free):
            return None
        page_ids = []
        for _ in range(num_pages):
            page_id, _ = self._free.popitem(last=False)
            if self._on_evict is not None:
                self._on_evict(page_id)
            self._ref_counts[page_id] = 1
            self._tags[page_id] += 1
            page_ids.append(page_id)
        return page_ids

    def touch(self, page_id: int) -> None:
        """Add a reference to a page that already holds wanted content (a prefix hit)."""
        if self._ref_counts[page_id] == 0:
            del self._free[page_id]
        self._ref_counts[page_id] += 1

    def free(self, page_ids: Iterable[int]) -> None:
        """Drop one reference from each page; pages reaching zero go to the back of the free queue."""
        for page_id in page_ids:
            if self._ref_counts[page_id] <= 0:
                raise PagePoolError(f"double free of KV page {page_id} (tag {self._tags[page_id]})")
            self._ref_counts[page_id] -= 1
            if self._ref_counts[page_id] == 0:
                self._free[page_id] = None

    def move_to_front(self, page_id: int) -> None:
        """Make a free page the next one to be reused (its cached content is worth less)."""
        self._free.move_to_end(page_id, last=False)

    # ---- checks (tests run this after every engine step) ---------------------------------------
    def check_consistency(self, owners: dict[str, list[int]]) -> None:
        """Assert the pool agrees with the page lists its owners hold.

        owners: request id -> page ids that request maps. Every reference must be accounted for,
        and free pages must be exactly the unreferenced ones.
        """
        expected = [0] * self.num_pages
        for page_ids in owners.values():
            for page_id in page_ids:
                expected[page_id] += 1
        for page_id in range(self.num_pages):
            refs = self._ref_counts[page_id]
            if refs != expected[page_id]:
                raise PagePoolError(
                    f"page {page_id}: ref_count {refs}, but {expected[page_id]} owners"
                )
            if (refs == 0) != (page_id in self._free):
                raise PagePoolError(
                    f"page {page_id}: ref_count {refs} but free={page_id in self._free}"
                )
