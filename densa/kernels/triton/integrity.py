"""The batched KV-page integrity check on the GPU (Triton): one kernel compares every (page,
expected tag) pair a step maps against the device tag table, and counts the mismatches.

It is launched on its own, before the forward pass, not fused into attention: attention's thread
blocks run in any order, so a check inside them could not stop another block of the same launch
from reading a page it has already found foreign; a separate launch finishes before any read.

    pairs   int64 [2, n]: row 0 page ids, row 1 expected tags (one host-to-device copy)
    tags    int64 [num_pages], the tag table
    ->      mismatch int8 [n] (1 where tags[page] != expected), count int32 [1]

The host reads back only `count` (one sync); the flags are read only when it is not zero.
"""

from __future__ import annotations

import torch

from densa.kernels.triton.common import require_triton, triton

BLOCK = 1024

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _tag_check_kernel(
        tags_ptr, pairs_ptr, num_pairs, mismatch_ptr, count_ptr, BLOCK: tl.constexpr
    ):
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = idx < num_pairs
        page = tl.load(pairs_ptr + idx, mask=ok, other=0)
        expected = tl.load(pairs_ptr + num_pairs + idx, mask=ok, other=0)
        found = tl.load(tags_ptr + page, mask=ok, other=0)
        bad = (found != expected) & ok
        tl.store(mismatch_ptr + idx, bad.to(tl.int8), mask=ok)
        tl.atomic_add(count_ptr, tl.sum(bad.to(tl.int32), axis=0))


def check_tags(tags: torch.Tensor, pairs: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(number of mismatching pairs, int8 flags [n]) for pairs [2, n] against tags [P]."""
    require_triton()
    num_pairs = pairs.shape[1]
    mismatch = torch.empty(num_pairs, dtype=torch.int8, device=tags.device)
    count = torch.zeros(1, dtype=torch.int32, device=tags.device)
    if num_pairs:
        pairs = pairs.contiguous()
        _tag_check_kernel[(triton.cdiv(num_pairs, BLOCK),)](
            tags, pairs, num_pairs, mismatch, count, BLOCK=BLOCK
        )
    return int(count.item()), mismatch


def mismatching_rows(tags: torch.Tensor, page_ids: list[int], expected: list[int]) -> list[int]:
    """Rows i with tags[page_ids[i]] != expected[i], as kernels/reference/integrity.py finds
    them: the pairs go to the device in one copy, and one 4-byte read-back says whether anything
    mismatched."""
    pairs = torch.tensor([page_ids, expected], dtype=torch.int64)  # [2, n]
    if tags.device.type == "cuda":
        pairs = pairs.pin_memory().to(tags.device, non_blocking=True)
    count, flags = check_tags(tags, pairs)
    if count == 0:
        return []
    return flags.nonzero().flatten().tolist()
