"""The physical KV page pool: which pages are free, who references them, and their generation tags.

Pages are integers 0..num_pages-1. The KV tensors themselves live in the worker; this module never
touches them. Every page is in exactly one of two states:

    owned   ref_count > 0, not in the free queue
    free    ref_count == 0, in the free queue (oldest first = next to be reused). A free page may
            still hold a reusable prefix (it keeps its hash) until it is reallocated (evicted).

Generation tags. A page's tag changes whenever its ownership ends or begins: on allocation and when
its last reference is dropped. Anyone still holding an old (page, tag) pair is therefore stale the
moment the page is released, not only once it is reused. Tags are unique across pages too:

    tag = generation * num_pages + page_id

so a tag names the page it was issued for (tag % num_pages). An expected tag issued for another page
means a corrupt mapping; one issued for this page but older means a stale holder. Reviving a cached
free page for a prefix hit (`touch`) keeps the tag: the content is unchanged and the new owner
records the current tag.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable


class PagePoolError(RuntimeError):
    """A bookkeeping bug (double free, freeing an unowned page). Never a normal "pool is full"."""


class PagePool:
    def __init__(self, num_pages: int, mirrored: bool = True) -> None:
        """mirrored: the worker keeps a device-side copy of the tags, fed by
        `drain_tag_updates` (the target's pool). A pool nobody mirrors (a proposer's own,
        spec/paged_rows.py) queues no updates: nothing would ever drain them."""
        if num_pages < 1:
            raise ValueError("the page pool needs at least one page")
        self.num_pages = num_pages
        self._ref_counts = [0] * num_pages
        self._tags = list(range(num_pages))  # generation 0
        # Two free queues; insertion order is eviction order and allocate() takes from the front of
        # `_free` first. `_protected` holds free pages whose cached prefix belongs to a live session
        # (x-session-affinity): they are reused only once no other free page is left.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._protected: OrderedDict[int, None] = OrderedDict()
        # Called with a page id when a free page is reallocated (its cached content is evicted).
        self._on_evict: Callable[[int], object] | None = None
        # Tag changes not yet mirrored by the worker's device-side tag table.
        self._tag_updates: list[tuple[int, int]] = []
        self._mirrored = mirrored

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free) + len(self._protected)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    def ref_count(self, page_id: int) -> int:
        return self._ref_counts[page_id]

    def tag(self, page_id: int) -> int:
        return self._tags[page_id]

    def tags(self, page_ids: Iterable[int]) -> list[int]:
        return [self._tags[p] for p in page_ids]

    def all_tags(self) -> list[int]:
        return list(self._tags)

    def is_free(self, page_id: int) -> bool:
        return page_id in self._free or page_id in self._protected

    def is_protected(self, page_id: int) -> bool:
        return page_id in self._protected

    def page_of_tag(self, tag: int) -> int:
        """The page a tag was issued for."""
        return tag % self.num_pages

    # ---- mutations -----------------------------------------------------------------------------
    def set_evict_callback(self, callback: Callable[[int], object]) -> None:
        self._on_evict = callback

    def allocate(self, num_pages: int) -> list[int] | None:
        """Take `num_pages` free pages (ref 1, new tag each). None, changing nothing, if too few."""
        if num_pages > self.num_free_pages:
            return None
        page_ids = []
        for _ in range(num_pages):
            queue = self._free if self._free else self._protected
            page_id, _ = queue.popitem(last=False)
            if self._on_evict is not None:
                self._on_evict(page_id)
            self._ref_counts[page_id] = 1
            self._bump_tag(page_id)
            page_ids.append(page_id)
        return page_ids

    def touch(self, page_id: int) -> None:
        """Add a reference to a page that already holds wanted content (a prefix hit)."""
        if self._ref_counts[page_id] == 0:
            self._free.pop(page_id, None)
            self._protected.pop(page_id, None)
        self._ref_counts[page_id] += 1

    def free(self, page_ids: Iterable[int], protect: bool = False) -> None:
        """Drop one reference from each page; pages reaching zero get a new tag and go to the back
        of the free queue (the protected one if `protect`). A double free raises before anything
        changes."""
        page_ids = list(page_ids)
        for page_id, count in Counter(page_ids).items():
            if self._ref_counts[page_id] < count:
                raise PagePoolError(f"double free of KV page {page_id} (tag {self._tags[page_id]})")
        for page_id in page_ids:
            self._ref_counts[page_id] -= 1
            if self._ref_counts[page_id] == 0:
                self._bump_tag(page_id)
                (self._protected if protect else self._free)[page_id] = None

    def move_to_front(self, page_id: int) -> None:
        """Make a free page the next one to be reused (its content is worth nothing)."""
        if self._protected.pop(page_id, 0) is None:
            self._free[page_id] = None
        self._free.move_to_end(page_id, last=False)

    def drain_tag_updates(self) -> list[tuple[int, int]]:
        """(page, new tag) for every tag change since the last call, oldest first."""
        updates, self._tag_updates = self._tag_updates, []
        return updates

    def _bump_tag(self, page_id: int) -> None:
        self._tags[page_id] += self.num_pages
        if self._mirrored:
            self._tag_updates.append((page_id, self._tags[page_id]))

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
            if (refs == 0) != self.is_free(page_id):
                raise PagePoolError(
                    f"page {page_id}: ref_count {refs} but free={self.is_free(page_id)}"
                )
            if self._tags[page_id] % self.num_pages != page_id:
                raise PagePoolError(f"page {page_id}: tag {self._tags[page_id]} names another page")
