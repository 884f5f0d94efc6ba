"""Fast CPU paged attention: a fused Numba decode kernel and an SDPA-based prefill path.

Cache layout, scales, page tables and GQA follow `paged_attention_ref` (see its module docstring).

Threading: Numba's parallel kernels and torch both run OpenMP-style worker pools. See
`numba_threads` for the choice made and why.
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
import torch
from numba import njit, prange

from densa.formats.kv_format import KVFormat
from densa.kernels.cpu import numba_threads  # noqa: F401  (must run before any parallel kernel)
from densa.kernels.cpu.kv_views import as_numpy, raw_cache, split_scale
from densa.kernels.cpu.numba_intrinsics import FASTMATH, dynamic_scale, exp_neg, prefetch, widen
from densa.kernels.cpu.prefill_attention import paged_prefill_attention

__all__ = ["paged_attention", "paged_decode_attention", "paged_prefill_attention"]


_NEG_BIG = np.float32(-1e30)  # "minus infinity" for the running max (exp of it underflows)
_BLOCK_TOKENS = 32  # tokens per online-softmax step (one accumulator rescale per block)
_PREFETCH_PAGES = 2  # how many pages ahead to prefetch; hides DRAM latency at page jumps
_MIN_SPLIT_TOKENS = 256  # below this, splitting a sequence costs more than it balances

# ---- decode kernel -----------------------------------------------------------------------------


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def _prefetch_page(cache, page, kv_head):
    """Prefetch one head's page block (page_size x head_dim, contiguous) line by line."""
    block = cache.shape[2] * cache.shape[3]
    base = (page * cache.shape[1] + kv_head) * block
    step = 64 // cache.itemsize
    for offset in range(0, block, step):
        prefetch(cache, base + offset)


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def _attend_range(
    q_group, k_cache, v_cache, page_row, kv_head, t0, t1, k_scales, v_scales, acc, run_max, run_sum
):
    """Online-softmax attention of one GQA group over token positions [t0, t1) of one sequence.

    t0 must be a multiple of the page size, so blocks always start at a page boundary.
    q_group: [G, D] queries already multiplied by sm_scale and every static K factor.
    k_cache/v_cache: raw [P, Hkv, S, D]; k_scales/v_scales: [P, Hkv, S] float32 scales or int8
    exponents, or empty (no dynamic scales).
    Writes the unnormalized accumulator acc [G, D], running max run_max [G] and sum run_sum [G].
    """
    group, head_dim = q_group.shape
    page_size = k_cache.shape[2]
    dyn_k = k_scales.shape[0] > 0
    dyn_v = v_scales.shape[0] > 0
    # Whole pages per block, at least one page.
    block = max(page_size, _BLOCK_TOKENS // page_size * page_size)
    probs = np.empty((group, block), dtype=np.float32)
    acc[:] = 0.0
    run_max[:] = _NEG_BIG
    run_sum[:] = 0.0
    last_page = (t1 + page_size - 1) // page_size
    for b0 in range(t0, t1, block):
        n = min(block, t1 - b0)
        first = b0 // page_size
        for i in range(0, n, page_size):
            page_index = first + i // page_size
            if page_index + _PREFETCH_PAGES < last_page:
                ahead = page_row[page_index + _PREFETCH_PAGES]
                _prefetch_page(k_cache, ahead, kv_head)
                _prefetch_page(v_cache, ahead, kv_head)
            page = page_row[page_index]
            for s in range(min(page_size, n - i)):
                scale = dynamic_scale(k_scales[page, kv_head, s]) if dyn_k else np.float32(1.0)
                t = i + s
                # The heads of a GQA group share each K row. For groups of 4 and 3 (common GQA
                # ratios) every element is loaded and widened once for all heads, with constant
                # head indices: written as a loop over head chunks, LLVM vectorizes it worse.
                if group == 4:
                    s0 = s1 = s2 = s3 = np.float32(0.0)
                    for d in range(head_dim):
                        x = widen(k_cache[page, kv_head, s, d])
                        s0 += q_group[0, d] * x
                        s1 += q_group[1, d] * x
                        s2 += q_group[2, d] * x
                        s3 += q_group[3, d] * x
                    probs[0, t], probs[1, t] = s0 * scale, s1 * scale
                    probs[2, t], probs[3, t] = s2 * scale, s3 * scale
                elif group == 3:
                    s0 = s1 = s2 = np.float32(0.0)
                    for d in range(head_dim):
                        x = widen(k_cache[page, kv_head, s, d])
                        s0 += q_group[0, d] * x
                        s1 += q_group[1, d] * x
                        s2 += q_group[2, d] * x
                    probs[0, t], probs[1, t], probs[2, t] = s0 * scale, s1 * scale, s2 * scale
                else:
                    for g in range(group):
                        s0 = np.float32(0.0)
                        for d in range(head_dim):
                            s0 += q_group[g, d] * widen(k_cache[page, kv_head, s, d])
                        probs[g, t] = s0 * scale
        # Online softmax: one accumulator rescale per block, not per token.
        for g in range(group):
            block_max = run_max[g]
            for t in range(n):
                block_max = max(block_max, probs[g, t])
            alpha = exp_neg(run_max[g] - block_max)
            run_max[g] = block_max
            total = np.float32(0.0)
            for t in range(n):
                p = exp_neg(probs[g, t] - block_max)
                probs[g, t] = p
                total += p
            run_sum[g] = run_sum[g] * alpha + total
            for d in range(head_dim):
                acc[g, d] *= alpha
        for i in range(0, n, page_size):
            page = page_row[first + i // page_size]
            for s in range(min(page_size, n - i)):
                scale = dynamic_scale(v_scales[page, kv_head, s]) if dyn_v else np.float32(1.0)
                t = i + s
                if group == 4:
                    w0, w1 = probs[0, t] * scale, probs[1, t] * scale
                    w2, w3 = probs[2, t] * scale, probs[3, t] * scale
                    for d in range(head_dim):
                        x = widen(v_cache[page, kv_head, s, d])
                        acc[0, d] += w0 * x
                        acc[1, d] += w1 * x
                        acc[2, d] += w2 * x
                        acc[3, d] += w3 * x
                elif group == 3:
                    w0, w1, w2 = probs[0, t] * scale, probs[1, t] * scale, probs[2, t] * scale
                    for d in range(head_dim):
                        x = widen(v_cache[page, kv_head, s, d])
                        acc[0, d] += w0 * x
                        acc[1, d] += w1 * x
                        acc[2, d] += w2 * x
                else:
                    for g in range(group):
                        w = probs[g, t] * scale
                        for d in range(head_dim):
                            acc[g, d] += w * widen(v_cache[page, kv_head, s, d])


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
def _decode_kernel(
    query,
    k_cache,
    v_cache,
    page_table,
    seq_lens,
    k_scales,
    v_scales,
    q_mult,
    v_mult,
    split_table,
    num_workers,
    out,
):
    """Split-K ("flash-decoding") paged attention for one new token per sequence.

    query/out: float32 [B, H, D]; q_mult / v_mult: static factors for scores / outputs;
    num_workers: threads to spread the work over. Work items are (sequence, kv head, split);
    sequence b's context is cut into split_table[min(seq_len // _MIN_SPLIT_TOKENS, last)]
    page-aligned shares (the splits it would get alone: `_split_table`), and a second pass merges
    the partial softmaxes in order (with one split that pass just normalizes).
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    page_size = k_cache.shape[2]
    group = num_heads // num_kv_heads
    # Sequence b's items are [first[b], first[b + 1]), kv head by kv head.
    first = np.zeros(batch + 1, dtype=np.int64)
    for b in range(batch):
        index = min(seq_lens[b] // _MIN_SPLIT_TOKENS, len(split_table) - 1)
        first[b + 1] = first[b] + num_kv_heads * split_table[index]
    num_items = first[batch]
    item_seq = np.empty(num_items, dtype=np.int64)
    for b in range(batch):
        item_seq[first[b] : first[b + 1]] = b
    part_acc = np.empty((num_items, group, head_dim), dtype=np.float32)
    part_m = np.empty((num_items, group), dtype=np.float32)
    part_l = np.empty((num_items, group), dtype=np.float32)
    # Round-robin items over the workers (one prange iteration each) instead of numba's
    # contiguous static chunks: batches are often ordered by length, and contiguous chunks would
    # hand one thread all the long sequences. (Dynamic scheduling via set_parallel_chunksize
    # costs ~4 us per call from Python, and calling it inside the kernel defeats cache=True.)
    num_workers = max(1, min(num_workers, num_items))
    for worker in prange(num_workers):
        q_group = np.empty((group, head_dim), dtype=np.float32)
        for item in range(worker, num_items, num_workers):
            b = item_seq[item]
            num_splits = (first[b + 1] - first[b]) // num_kv_heads
            kv_head = (item - first[b]) // num_splits
            split = (item - first[b]) % num_splits
            seq_len = seq_lens[b]
            pages_per_split = (
                (seq_len + page_size - 1) // page_size + num_splits - 1
            ) // num_splits
            t0 = min(split * pages_per_split * page_size, seq_len)
            t1 = min(t0 + pages_per_split * page_size, seq_len)
            for g in range(group):
                for d in range(head_dim):
                    q_group[g, d] = query[b, kv_head * group + g, d] * q_mult
            _attend_range(
                q_group,
                k_cache,
                v_cache,
                page_table[b],
                kv_head,
                t0,
                t1,
                k_scales,
                v_scales,
                part_acc[item],
                part_m[item],
                part_l[item],
            )
    for bh in prange(batch * num_heads):
        b = bh // num_heads
        h = bh % num_heads
        num_splits = (first[b + 1] - first[b]) // num_kv_heads
        head_first = first[b] + (h // group) * num_splits
        g = h % group
        top = _NEG_BIG
        for s in range(num_splits):
            top = max(top, part_m[head_first + s, g])
        total = np.float32(0.0)
        for d in range(head_dim):
            out[b, h, d] = 0.0
        for s in range(num_splits):
            w = exp_neg(part_m[head_first + s, g] - top)
            total += w * part_l[head_first + s, g]
            for d in range(head_dim):
                out[b, h, d] += w * part_acc[head_first + s, g, d]
        # An empty sequence (seq_len 0) has total 0: leave its output at zero rather than NaN.
        inv = v_mult / total if total > 0 else np.float32(0.0)
        for d in range(head_dim):
            out[b, h, d] *= inv


# ---- Python wrappers ---------------------------------------------------------------------------


def _choose_num_splits(num_pairs: int, max_seq_len: int, num_threads: int) -> int:
    """Splits per (sequence, kv head) so the work items balance across threads.

    Only splits when there are too few (sequence, kv head) pairs to keep every thread busy and
    each split still gets at least _MIN_SPLIT_TOKENS tokens.
    """
    max_splits = max(1, max_seq_len // _MIN_SPLIT_TOKENS)
    if num_pairs >= 4 * num_threads or max_splits == 1:
        return 1
    best, best_waste = 1, math.inf
    for splits in range(1, min(max_splits, 8 * num_threads) + 1):
        items = num_pairs * splits
        # Idle fraction of the slowest thread, plus a small per-split merge penalty.
        waste = math.ceil(items / num_threads) * num_threads / items - 1 + 0.01 * splits
        if waste < best_waste:
            best, best_waste = splits, waste
    return best


@functools.cache
def _split_table(num_kv_heads: int, num_threads: int) -> np.ndarray:
    """Splits of one sequence as if it were alone in the batch, by seq_len // _MIN_SPLIT_TOKENS
    (the last entry holds for every longer context). Decode cuts each sequence by this table,
    so how a sequence is split, and so its result, never depends on the rest of the batch."""
    longest = (8 * num_threads + 1) * _MIN_SPLIT_TOKENS  # splits never exceed 8 * threads
    lengths = range(0, longest + 1, _MIN_SPLIT_TOKENS)
    splits = [_choose_num_splits(num_kv_heads, n, num_threads) for n in lengths]
    return np.array(splits, dtype=np.int64)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    kv_format: KVFormat | None = None,
) -> torch.Tensor:
    """Decode attention (one new token per sequence) with the fused Numba kernel.

    query: float32 [B, H, D]; caches [P, Hkv, S, D]; page_table int32 [B, max_pages];
    seq_lens int32 [B] (including the new token). out: optional float32 [B, H, D] to write into.
    Returns float32 [B, H, D].
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError("query / cache shapes do not match")
    if out is None:
        out = torch.empty((batch, num_heads, head_dim), dtype=torch.float32)
    elif out.shape != query.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("out must be a contiguous float32 tensor shaped like query")
    if batch == 0:
        return out
    k_raw, k_factor = raw_cache(k_cache)
    v_raw, v_factor = raw_cache(v_cache)
    k_dyn, k_static = split_scale(k_scale, k_cache, kv_format)
    v_dyn, v_static = split_scale(v_scale, v_cache, kv_format)
    table = as_numpy(page_table, torch.int32)
    lens = as_numpy(seq_lens, torch.int32)
    if table.shape[0] != batch or lens.shape != (batch,):
        raise ValueError("page_table and seq_lens need one row / entry per query")
    max_seq_len = int(lens.max())
    if max_seq_len > table.shape[1] * k_cache.shape[2]:
        raise ValueError("seq_lens exceed the page table capacity")
    # The kernel does no bounds checks, so a bad page id would read arbitrary memory.
    if table.size and (table.min() < 0 or table.max() >= k_cache.shape[0]):
        raise IndexError("page_table holds page ids outside the cache")
    num_threads = numba.get_num_threads()
    _decode_kernel(
        as_numpy(query, torch.float32),
        k_raw,
        v_raw,
        table,
        lens,
        k_dyn,
        v_dyn,
        np.float32(sm_scale * k_static * k_factor),
        np.float32(v_static * v_factor),
        _split_table(num_kv_heads, num_threads),
        num_threads,
        out.numpy(),
    )
    return out


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Mixed batch: sequences with query_len == 1 use the fused decode kernel, the rest the
    prefill path. Same arguments and result as `paged_prefill_attention` ([total_q, H, D]);
    `new_kv` applies to the prefill rows only (decode rows always read the cache)."""
    is_decode = query_lens == 1
    if bool(is_decode.all()):
        return paged_decode_attention(
            query, k_cache, v_cache, page_table, seq_lens, sm_scale, k_scale, v_scale
        )
    if not bool(is_decode.any()):
        return paged_prefill_attention(
            query, k_cache, v_cache, page_table, seq_lens, query_lens, sm_scale, k_scale, v_scale,
            new_kv,
        )  # fmt: skip
    query_lens = query_lens.to(torch.int64)
    seq_of_row = torch.repeat_interleave(
        torch.arange(len(query_lens)), query_lens, output_size=query.shape[0]
    )
    decode_rows = is_decode[seq_of_row]  # a decode sequence owns exactly one row
    out = torch.empty(query.shape, dtype=torch.float32)
    out[decode_rows] = paged_decode_attention(
        query[decode_rows],
        k_cache,
        v_cache,
        page_table[is_decode],
        seq_lens[is_decode],
        sm_scale,
        k_scale,
        v_scale,
    )
    prefill = ~is_decode
    prefill_kv = None if new_kv is None else (new_kv[0][~decode_rows], new_kv[1][~decode_rows])
    out[~decode_rows] = paged_prefill_attention(
        query[~decode_rows],
        k_cache,
        v_cache,
        page_table[prefill],
        seq_lens[prefill],
        query_lens[prefill],
        sm_scale,
        k_scale,
        v_scale,
        prefill_kv,
    )
    return out
