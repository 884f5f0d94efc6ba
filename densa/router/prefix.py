"""The router's approximate picture of each worker's prefix cache.

The router hashes a prompt's page-sized token blocks with the workers' own chain
(`densa.cache.prefix_index.hash_block`, seeded by the request's cache-scope digest), so a block
hash here names exactly the KV page a worker would look up. A tenant's blocks therefore never
match another tenant's: the scope is inside the first hash, and every later hash chains from it.
The router cannot see the workers' caches, so it remembers what it sent where:

    after routing prompt P (blocks h0 h1 h2) to worker W:  W's index holds h0 h1 h2 (most recent)
    a later prompt with blocks h0 h1 h7:                   W matches 2 leading blocks

Each worker's index is an LRU bounded by that worker's KV pool (it cannot hold more pages than
that), and is dropped when the worker restarts or is ejected (its cache is gone). It is
approximate both ways: the worker may have evicted a block the router still lists, and it also
caches blocks of generated text the router never saw.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from densa.cache.prefix_index import BlockHash, hash_block


def block_hashes(token_ids: Sequence[int], page_size: int, scope: str) -> list[BlockHash]:
    """The hashes a worker's prefix cache may hold for this prompt: every full block but the
    one holding the last token (a worker always recomputes at least that token; see
    KVManager.find_prefix)."""
    num_blocks = max(len(token_ids) - 1, 0) // page_size
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for i in range(num_blocks):
        parent = hash_block(parent, token_ids[i * page_size : (i + 1) * page_size], scope)
        hashes.append(parent)
    return hashes


class WorkerPrefixIndex:
    """One worker's recently routed blocks, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 1)
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `hashes` this worker probably holds (no mutation)."""
        num_matched = 0
        for block_hash in hashes:
            if block_hash not in self._blocks:
                break
            num_matched += 1
        return num_matched

    def insert(self, hashes: Sequence[BlockHash]) -> None:
        """Record that the worker now caches these blocks; evict the oldest past capacity."""
        for block_hash in hashes:
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


# Stores one router keeps an index for: a worker's report names its store, so a misbehaving one
# could name a new store every poll; the least recently used store's index goes first.
MAX_SHARED_STORES = 16


class SharedTierIndex:
    """Blocks fetchable from shared KV tiers, one LRU index per store: a prompt routed to a
    worker that writes to store S (and, in a prefill/decode split, its prefill worker) can be
    fetched by every worker that reads S. Which store a worker reads is what it reports
    (`/densa/load`'s opaque shared_kv_tier id), or one store for all (--shared-kv-tier)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._stores: OrderedDict[str, WorkerPrefixIndex] = OrderedDict()

    def match(self, store: str | None, hashes: Sequence[BlockHash]) -> int:
        index = self._stores.get(store) if store else None
        return index.match(hashes) if index is not None else 0

    def insert(self, store: str | None, hashes: Sequence[BlockHash]) -> None:
        if not store:
            return
        index = self._stores.get(store)
        if index is None:
            index = self._stores[store] = WorkerPrefixIndex(self.capacity)
        self._stores.move_to_end(store)
        index.insert(hashes)
        while len(self._stores) > MAX_SHARED_STORES:
            self._stores.popitem(last=False)
