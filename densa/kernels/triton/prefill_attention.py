"""Paged prefill attention on the GPU (Triton): chunks of new tokens of variable length, causal,
attending to earlier context already cached in pages (prefix hits, earlier chunks) and to
themselves.

Layout as in `densa.kernels.reference.paged_attention`. One program per (sequence, query head, block
of BLOCK_M query rows); the rows of all sequences are concatenated ([T, H, D]) and each
sequence's first row is found from the cumulative query lengths. Keys come in two ranges:

    positions  0 .. ctx_len-1            earlier context: read from the pages, no mask needed
    positions  ctx_len .. seq_len-1      this chunk: causal mask, read from the pages, or (FP8
                                          pages) from the chunk's own K/V as computed (`new_kv`)

so an FP8 prefill attends to its own tokens in high precision, as the torch backend does.
Scales (static or per token) multiply the score and probability tiles, as in the decode kernel.
"""

from __future__ import annotations

import math

import torch

from densa.formats.kv_format import KVFormat
from densa.kernels.triton.common import (
    SCALE_NONE,
    check_layouts,
    interpreting,
    next_power_of_2,
    or_dummy,
    require_triton,
    scale_mode,
    token_scale_strides,
    triton,
)

if triton is not None:
    import triton.language as tl

    from densa.kernels.triton.common import block_scales, mma

    @triton.jit
    def _attend_block(
        q, k, v, k_mult, v_mult, mask, run_max, run_sum, acc, factor, WIDEN: tl.constexpr
    ):
        """One online-softmax step over a [BLOCK_N] block of keys; returns the new state."""
        scores = mma(q, tl.trans(k.to(q.dtype)), tl.zeros(mask.shape, tl.float32), WIDEN)
        scores = tl.where(mask, scores * factor * k_mult[None, :], float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        alpha = tl.exp2(run_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        run_sum = run_sum * alpha + tl.sum(probs, axis=1)
        acc = mma((probs * v_mult[None, :]).to(q.dtype), v.to(q.dtype), acc * alpha[:, None], WIDEN)
        return new_max, run_sum, acc

    @triton.jit
    def _prefill_kernel(
        q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, new_k_ptr, new_v_ptr,
        table_ptr, seq_lens_ptr, query_lens_ptr, query_starts_ptr, out_ptr,
        qk_factor,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cp, stride_ch, stride_cs,
        stride_sp, stride_sh,
        stride_nkt, stride_nkh, stride_nvt, stride_nvh,
        stride_tb,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        K_SCALES: tl.constexpr, V_SCALES: tl.constexpr, HAS_NEW_KV: tl.constexpr,
        WIDEN: tl.constexpr,
    ):  # fmt: skip
        seq, head, m_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        q_len = tl.load(query_lens_ptr + seq)
        if m_block * BLOCK_M >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        q_start = tl.load(query_starts_ptr + seq)
        ctx_len = seq_len - q_len
        kv_head = head // GROUP
        q_idx = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows within the chunk
        dims = tl.arange(0, BLOCK_D)
        q_ok, dim_ok = q_idx < q_len, dims < HEAD_DIM
        q_rows = (q_start + q_idx).to(tl.int64)
        q = tl.load(
            q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :],
            mask=q_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        run_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        run_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        keys = tl.arange(0, BLOCK_N)
        # Earlier context, from the pages: every query row sees all of it.
        for block_start in range(0, ctx_len, BLOCK_N):
            tokens = block_start + keys
            token_ok = tokens < ctx_len
            page = tl.load(
                table_ptr + seq * stride_tb + tokens // PAGE_SIZE, mask=token_ok, other=0
            )
            slot = tokens % PAGE_SIZE
            row = page.to(tl.int64) * stride_cp + kv_head * stride_ch + slot * stride_cs
            kv_mask = token_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            scale_row = page.to(tl.int64) * stride_sp + kv_head * stride_sh + slot
            k_mult = block_scales(k_scale_ptr, scale_row, token_ok, K_SCALES)
            v_mult = block_scales(v_scale_ptr, scale_row, token_ok, V_SCALES)
            mask = q_ok[:, None] & token_ok[None, :]
            run_max, run_sum, acc = _attend_block(
                q, k, v, k_mult, v_mult, mask, run_max, run_sum, acc, qk_factor, WIDEN
            )
        # This chunk, causal: query row i sees chunk keys 0..i.
        chunk_end = tl.minimum(q_len, (m_block + 1) * BLOCK_M)
        for block_start in range(0, chunk_end, BLOCK_N):
            idx = block_start + keys  # key index within the chunk
            idx_ok = idx < q_len
            kv_mask = idx_ok[:, None] & dim_ok[None, :]
            mask = q_ok[:, None] & idx_ok[None, :] & (idx[None, :] <= q_idx[:, None])
            if HAS_NEW_KV:
                new_row = (q_start + idx).to(tl.int64)
                k_row = new_row * stride_nkt + kv_head * stride_nkh
                v_row = new_row * stride_nvt + kv_head * stride_nvh
                k = tl.load(new_k_ptr + k_row[:, None] + dims[None, :], mask=kv_mask, other=0.0)
                v = tl.load(new_v_ptr + v_row[:, None] + dims[None, :], mask=kv_mask, other=0.0)
                k_mult = block_scales(k_scale_ptr, idx, idx_ok, 0)
                v_mult = k_mult
            else:
                tokens = ctx_len + idx
                page = tl.load(
                    table_ptr + seq * stride_tb + tokens // PAGE_SIZE, mask=idx_ok, other=0
                )
                slot = tokens % PAGE_SIZE
                row = page.to(tl.int64) * stride_cp + kv_head * stride_ch + slot * stride_cs
                k = tl.load(k_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0.0)
                v = tl.load(v_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0.0)
                scale_row = page.to(tl.int64) * stride_sp + kv_head * stride_sh + slot
                k_mult = block_scales(k_scale_ptr, scale_row, idx_ok, K_SCALES)
                v_mult = block_scales(v_scale_ptr, scale_row, idx_ok, V_SCALES)
            run_max, run_sum, acc = _attend_block(
                q, k, v, k_mult, v_mult, mask, run_max, run_sum, acc, qk_factor, WIDEN
            )
        out = acc / tl.where(run_sum > 0, run_sum, 1.0)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=q_ok[:, None] & dim_ok[None, :],
        )


def block_sizes(head_dim: int) -> tuple[int, int]:
    """(BLOCK_M query rows, BLOCK_N keys) per step; smaller for wide heads (registers)."""
    return (64, 64) if head_dim <= 128 else (32, 32)


def paged_prefill_attention(
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
    max_query_len: int | None = None,
    kv_format: KVFormat | None = None,
) -> torch.Tensor:
    """query [T, H, D] (sequence i owns query_lens[i] consecutive rows, the last tokens of its
    seq_lens[i]) -> [T, H, D] in query's dtype. new_kv: the chunk's own (k, v) [T, KVH, D].

    max_query_len sizes the grid; pass it when known (it avoids reading query_lens back)."""
    require_triton()
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_seqs = page_table.shape[0]
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    check_layouts(query, k_cache, v_cache, *(new_kv or ()))
    if max_query_len is None:
        max_query_len = int(query_lens.max())
    lens = query_lens.to(torch.int64)
    query_starts = torch.cumsum(lens, 0) - lens  # first row of each sequence
    block_m, block_n = block_sizes(head_dim)
    out = torch.empty_like(query)
    new_k, new_v = new_kv if new_kv is not None else (query, query)
    grid = (num_seqs, num_heads, math.ceil(max_query_len / block_m))
    _prefill_kernel[grid](
        query, k_cache, v_cache, or_dummy(k_scale, query), or_dummy(v_scale, query), new_k, new_v,
        page_table, seq_lens, query_lens, query_starts, out,
        sm_scale * math.log2(math.e),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *token_scale_strides(k_scale, v_scale),
        new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1),
        page_table.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
        K_SCALES=scale_mode(k_scale, kv_format), V_SCALES=scale_mode(v_scale, kv_format),
        HAS_NEW_KV=new_kv is not None, WIDEN=interpreting(),
    )  # fmt: skip
    return out


__all__ = ["SCALE_NONE", "paged_prefill_attention"]
