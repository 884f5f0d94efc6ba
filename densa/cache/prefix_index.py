"""Content addressing for full KV pages: a hash chain over page-sized blocks of tokens.

The hash of block i covers the cache scope (tenant) and every token of blocks 0..i, nothing else:
two requests share a page only if they share the whole prefix up to and including it, in the same
scope. A cryptographic hash (BLAKE2b) makes it infeasible to craft a prompt whose block collides
with another tenant's block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], scope: str) -> BlockHash:
    digest = hashlib.blake2b(digest_size=16)
    if parent is None:
        digest.update(b"scope:" + scope.encode("utf-8") + b"\x00")
    else:
        digest.update(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class PrefixIndex:
    """Two-way map between block hashes and the pages that hold those blocks."""

    def __init__(self) -> None:
        self._page_by_hash: dict[BlockHash, int] = {}
        self._hash_by_page: dict[int, BlockHash] = {}

    def __len__(self) -> int:
        return len(self._page_by_hash)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._page_by_hash.get(block_hash)

    def hash_of(self, page_id: int) -> BlockHash | None:
        return self._hash_by_page.get(page_id)

    def has_page(self, page_id: int) -> bool:
        return page_id in self._hash_by_page

    def insert(self, block_hash: BlockHash, page_id: int) -> None:
        """Record that page_id holds this block. First writer wins: a duplicate stays unindexed."""
        if block_hash in self._page_by_hash or page_id in self._hash_by_page:
            return
        self._page_by_hash[block_hash] = page_id
        self._hash_by_page[page_id] = block_hash

    def evict(self, page_id: int) -> bool:
        """Forget the block a page held (it is being reallocated). True if it held one."""
        block_hash = self._hash_by_page.pop(page_id, None)
        if block_hash is None:
            return False
        del self._page_by_hash[block_hash]
        return True

    def clear(self) -> None:
        self._page_by_hash.clear()
        self._hash_by_page.clear()
