"""Paged decode attention on the GPU (Triton): one new token per sequence, split-K over the
context (flash-decoding), GQA, BF16/FP16/FP32 or FP8 pages read in place.

Layout as in `densa.kernels.reference.paged_attention` (pages [P, KVH, S, D], page table, scales).

Stage 1, one program per (sequence, kv head, split): the program holds the GROUP query heads
that share its kv head as the rows of one [BLOCK_H, D] tile (padded to 16 rows for the tensor
cores), and walks its split's tokens BLOCK_N at a time:

    page = page_table[b, token // S], slot = token % S        (pages are read where they lie)
    scores [BLOCK_H, BLOCK_N] = q @ k^T * sm_scale * k_scale[token]
    online softmax; acc [BLOCK_H, D] += (p * v_scale[token]) @ v

FP8 scales are applied to the [BLOCK_H, BLOCK_N] score and probability tiles, in registers,
not to the [BLOCK_N, D] K/V tiles: a per-token scale factors out of the dot over D, so the
widened fp8 values go to the tensor cores unscaled and 16x fewer multiplies remain.
It writes its normalized partial output and log-sum-exp (base 2). Stage 2, one program per
(sequence, head), merges the splits. A split past a sequence's end writes lse = -inf and adds
nothing, so the grid can be sized for the longest context (CUDA graphs need a fixed grid), and
a sequence of length 0 (a padding row) gets zeros.
"""

from __future__ import annotations

import math

import torch

from densa.formats.kv_format import KVFormat
from densa.kernels.triton.common import (
    check_layouts,
    interpreting,
    multiprocessors,
    next_power_of_2,
    or_dummy,
    require_triton,
    scale_mode,
    token_scale_strides,
    triton,
)

if triton is not None:
    import triton.language as tl

    from densa.kernels.triton.common import mma, token_scales

    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_ptr, seq_lens_ptr,
        part_out_ptr, part_lse_ptr,
        qk_factor, tokens_per_split,
        stride_qb, stride_qh,
        stride_cp, stride_ch, stride_cs,
        stride_sp, stride_sh,
        stride_tb,
        stride_ob, stride_oh, stride_os,
        GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
        K_SCALES: tl.constexpr, V_SCALES: tl.constexpr, WIDEN: tl.constexpr,
    ):  # fmt: skip
        seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + seq)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, seq_len)
        rows = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + rows  # [BLOCK_H] query heads of this kv head
        dims = tl.arange(0, BLOCK_D)
        head_ok, dim_ok = rows < GROUP, dims < HEAD_DIM
        q = tl.load(
            q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=head_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [BLOCK_H, BLOCK_D]
        factor = qk_factor  # sm_scale * log2(e), times a static K scale
        if K_SCALES == 1:
            factor = factor * tl.load(k_scale_ptr)
        run_max = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        run_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for block_start in range(start, end, BLOCK_N):
            tokens = block_start + tl.arange(0, BLOCK_N)
            token_ok = tokens < end
            page = tl.load(
                table_ptr + seq * stride_tb + tokens // PAGE_SIZE, mask=token_ok, other=0
            )
            slot = tokens % PAGE_SIZE
            row = page.to(tl.int64) * stride_cp + kv_head * stride_ch + slot * stride_cs  # [BN]
            kv_mask = token_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            scores = mma(
                q, tl.trans(k.to(q.dtype)), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), WIDEN
            )
            scores = scores * factor
            scale_row = page.to(tl.int64) * stride_sp + kv_head * stride_sh + slot
            if K_SCALES >= 2:
                scores = scores * token_scales(k_scale_ptr, scale_row, token_ok, K_SCALES)[None, :]
            scores = tl.where(token_ok[None, :], scores, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(scores, axis=1))
            alpha = tl.exp2(run_max - new_max)
            probs = tl.exp2(scores - new_max[:, None])  # [BLOCK_H, BLOCK_N]
            run_sum = run_sum * alpha + tl.sum(probs, axis=1)
            if V_SCALES >= 2:
                probs = probs * token_scales(v_scale_ptr, scale_row, token_ok, V_SCALES)[None, :]
            v = tl.load(v_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            acc = mma(probs.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], WIDEN)
            run_max = new_max
        has_tokens = run_sum > 0
        safe_sum = tl.where(has_tokens, run_sum, 1.0)
        out = acc / safe_sum[:, None]
        if V_SCALES == 1:
            out = out * tl.load(v_scale_ptr)
        lse = tl.where(has_tokens, run_max + tl.log2(safe_sum), float("-inf"))
        base = seq * stride_ob + heads * stride_oh + split * stride_os  # [BLOCK_H]
        tl.store(
            part_out_ptr + base[:, None] + dims[None, :],
            out,
            mask=head_ok[:, None] & dim_ok[None, :],
        )
        # part_lse is part_out without its last dimension: the same index divided by HEAD_DIM.
        tl.store(part_lse_ptr + base // HEAD_DIM, lse, mask=head_ok)

    @triton.jit
    def _decode_merge_kernel(
        part_out_ptr, part_lse_ptr, out_ptr,
        num_splits,
        stride_ob, stride_oh, stride_os,
        stride_yb, stride_yh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        seq, head = tl.program_id(0), tl.program_id(1)
        splits = tl.arange(0, BLOCK_S)
        dims = tl.arange(0, BLOCK_D)
        split_ok, dim_ok = splits < num_splits, dims < HEAD_DIM
        base = seq * stride_ob + head * stride_oh + splits * stride_os  # [BLOCK_S]
        lse = tl.load(part_lse_ptr + base // HEAD_DIM, mask=split_ok, other=float("-inf"))
        top = tl.max(lse, axis=0)
        top = tl.where(top > float("-inf"), top, 0.0)  # a padding row: no split has tokens
        weights = tl.where(lse > float("-inf"), tl.exp2(lse - top), 0.0)  # [BLOCK_S]
        parts = tl.load(
            part_out_ptr + base[:, None] + dims[None, :],
            mask=split_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [BLOCK_S, BLOCK_D]
        total = tl.sum(weights, axis=0)
        out = tl.sum(parts * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(
            out_ptr + seq * stride_yb + head * stride_yh + dims,
            out.to(out_ptr.dtype.element_ty),
            mask=dim_ok,
        )


MAX_SPLITS = 64


def block_tokens(head_dim: int) -> int:
    """Tokens per stage-1 step: a K tile of BLOCK_N x D stays around 16 KiB in 16-bit."""
    return 64 if head_dim <= 128 else 32


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device
) -> int:
    """Enough splits that stage 1 has ~2 programs per multiprocessor, but none shorter than a
    block of tokens (each split costs a partial output and a merge term)."""
    sms = multiprocessors(device)
    wanted = math.ceil(2 * sms / max(1, num_seqs * num_kv_heads))
    max_useful = max(1, math.ceil(max_context / 64))
    return max(1, min(wanted, max_useful, MAX_SPLITS))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    kv_format: KVFormat | None = None,
) -> torch.Tensor:
    """query [B, H, D] (one token per sequence) -> [B, H, D] in query's dtype.

    The grid depends only on shapes (B, heads, page_table's width), never on the values in
    seq_lens, so the call can be captured in a CUDA graph and replayed with new lengths.
    """
    require_triton()
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    check_layouts(query, k_cache, v_cache)
    group = num_heads // num_kv_heads
    max_context = page_table.shape[1] * page_size
    block_n = block_tokens(head_dim)
    splits = num_splits or choose_num_splits(num_seqs, num_kv_heads, max_context, query.device)
    tokens_per_split = math.ceil(math.ceil(max_context / splits) / block_n) * block_n
    # [B, H, splits, D] partial outputs, and their log-sum-exps laid out as [B, H, splits].
    part_out = torch.empty(
        num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=query.device
    )
    part_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=query.device)
    stride_sp, stride_sh = token_scale_strides(k_scale, v_scale)
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        query, k_cache, v_cache, or_dummy(k_scale, query), or_dummy(v_scale, query),
        page_table, seq_lens, part_out, part_lse,
        sm_scale * math.log2(math.e), tokens_per_split,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        stride_sp, stride_sh,
        page_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        GROUP=group, BLOCK_H=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        PAGE_SIZE=page_size, BLOCK_N=block_n,
        K_SCALES=scale_mode(k_scale, kv_format), V_SCALES=scale_mode(v_scale, kv_format),
        WIDEN=interpreting(),
    )  # fmt: skip
    out = torch.empty_like(query)
    _decode_merge_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out,
        splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), BLOCK_S=next_power_of_2(splits),
    )  # fmt: skip
    return out
