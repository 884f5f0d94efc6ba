"""Sparse MLA decode on the CPU: weight-absorbed attention of one query per sequence over only
the latent rows the DSA indexer selected (densa.model.dsa), read in place from the pages.

    for each sequence b, its selected positions p_1..p_k (-1: none):
        row_j  = latent[page_table[b, p_j // S], 0, p_j % S]       [r + rope], widened
        s[h,j] = (q[b, h] . row_j) * scale                          every head reads row_j once
        out[b, h] = sum_j softmax_j(s[h]) row_j[:r]                  the latent doubles as V

A step reads k rows per sequence and layer (2048 in the released models), not its whole
context. Work is split over (sequence, share of its k rows) so one sequence keeps every thread
busy; each share keeps its own softmax max and sum, merged in order after (as flash-decoding
merges a context's splits). The torch reference is densa.model.latent_attention's
_torch_sparse_decode (gather the rows, one SDPA).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange

from densa.formats.kv_format import KVFormat
from densa.kernels.cpu import numba_threads  # noqa: F401  (must run before any parallel kernel)
from densa.kernels.cpu.kv_views import as_numpy, raw_cache, split_scale
from densa.kernels.cpu.numba_intrinsics import FASTMATH, dynamic_scale, exp_neg, widen

_NEG_BIG = np.float32(-1e30)
_MIN_SHARE_ROWS = 64  # a share of fewer rows costs more to merge than it balances


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def _attend_share(query, cache, scales, page_row, positions, j0, j1, q_mult, r, acc, top, total):
    """Attention of every head of one sequence over its selected rows [j0, j1): unnormalized
    acc [H, r], per-head max top [H] and sum total [H] (scores scaled by q_mult)."""
    num_heads, dim = query.shape
    page_size = cache.shape[2]
    dyn = scales.shape[0] > 0
    n = j1 - j0
    scores = np.empty((num_heads, max(n, 1)), dtype=np.float32)
    row = np.empty(dim, dtype=np.float32)
    acc[:] = 0.0
    top[:] = _NEG_BIG
    total[:] = 0.0
    for j in range(n):  # pass 1: scores, each row widened once for all heads
        pos = positions[j0 + j]
        if pos < 0:
            for h in range(num_heads):
                scores[h, j] = _NEG_BIG
            continue
        page, slot = page_row[pos // page_size], pos % page_size
        scale = dynamic_scale(scales[page, 0, slot]) if dyn else np.float32(1.0)
        for d in range(dim):
            row[d] = widen(cache[page, 0, slot, d])
        for h in range(num_heads):
            s = np.float32(0.0)
            for d in range(dim):
                s += query[h, d] * row[d]
            scores[h, j] = s * scale * q_mult
            top[h] = max(top[h], scores[h, j])
    for h in range(num_heads):  # the softmax weights of the share
        for j in range(n):
            p = exp_neg(scores[h, j] - top[h]) if scores[h, j] > _NEG_BIG else np.float32(0.0)
            scores[h, j] = p
            total[h] += p
    for j in range(n):  # pass 2: weighted latents (the rows' first r values)
        pos = positions[j0 + j]
        if pos < 0:
            continue
        page, slot = page_row[pos // page_size], pos % page_size
        scale = dynamic_scale(scales[page, 0, slot]) if dyn else np.float32(1.0)
        for d in range(r):
            row[d] = widen(cache[page, 0, slot, d]) * scale
        for h in range(num_heads):
            w = scores[h, j]
            for d in range(r):
                acc[h, d] += w * row[d]


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
def _sparse_decode_kernel(query, cache, scales, page_table, positions, q_mult, v_mult, r,
                          num_shares, out):  # fmt: skip
    """query [B, H, D], positions [B, k] -> out [B, H, r]; num_shares per sequence."""
    batch, num_heads, _ = query.shape
    num_rows = positions.shape[1]
    per_share = (num_rows + num_shares - 1) // num_shares
    items = batch * num_shares
    part_acc = np.empty((items, num_heads, r), dtype=np.float32)
    part_top = np.empty((items, num_heads), dtype=np.float32)
    part_total = np.empty((items, num_heads), dtype=np.float32)
    for item in prange(items):
        b, share = item // num_shares, item % num_shares
        j0 = min(share * per_share, num_rows)
        j1 = min(j0 + per_share, num_rows)
        _attend_share(query[b], cache, scales, page_table[b], positions[b], j0, j1, q_mult, r,
                      part_acc[item], part_top[item], part_total[item])  # fmt: skip
    for bh in prange(batch * num_heads):
        b, h = bh // num_heads, bh % num_heads
        first = b * num_shares
        top = _NEG_BIG
        for s in range(num_shares):
            top = max(top, part_top[first + s, h])
        total = np.float32(0.0)
        for d in range(r):
            out[b, h, d] = 0.0
        for s in range(num_shares):
            w = (
                exp_neg(part_top[first + s, h] - top)
                if part_total[first + s, h] > 0
                else np.float32(0.0)
            )
            total += w * part_total[first + s, h]
            for d in range(r):
                out[b, h, d] += w * part_acc[first + s, h, d]
        inv = v_mult / total if total > 0 else np.float32(0.0)
        for d in range(r):
            out[b, h, d] *= inv


def sparse_latent_decode(
    query: torch.Tensor,
    latent: torch.Tensor,
    page_table: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    latent_scale: torch.Tensor | None = None,
    kv_format: KVFormat | None = None,
) -> torch.Tensor:
    """query: float32 [B, H, r + rope]; latent pages [P, 1, S, r + rope] (any KV format, its
    scales in `latent_scale`); page_table int32 [B, max_pages]; positions int64 [B, k] (-1:
    none) -> float32 [B, H, r]."""
    batch, num_heads, dim = query.shape
    if latent.shape[1] != 1 or latent.shape[3] != dim or positions.shape[0] != batch:
        raise ValueError("query / latent pages / positions shapes do not match")
    out = torch.zeros((batch, num_heads, kv_lora_rank), dtype=torch.float32)
    if batch == 0 or positions.shape[1] == 0:
        return out
    raw, factor = raw_cache(latent)
    dyn, static = split_scale(latent_scale, latent, kv_format)
    table = as_numpy(page_table, torch.int32)
    chosen = as_numpy(positions, torch.int64)
    # The kernel does no bounds checks: every selected row must be inside its sequence's pages.
    if int(chosen.max()) >= table.shape[1] * latent.shape[2]:
        raise IndexError("a selected position lies past the page table")
    if table.size and (table.min() < 0 or table.max() >= latent.shape[0]):
        raise IndexError("page_table holds page ids outside the cache")
    threads = numba.get_num_threads()
    shares = max(1, min(-(-threads // batch), positions.shape[1] // _MIN_SHARE_ROWS))
    _sparse_decode_kernel(
        as_numpy(query, torch.float32), raw, dyn, table, chosen,
        np.float32(scale * static * factor), np.float32(static * factor), kv_lora_rank, shares,
        out.numpy(),
    )  # fmt: skip
    return out
