"""Sparse MLA decode on the GPU (Triton): weight-absorbed attention of one query per sequence
over only the latent rows the DSA indexer selected (densa.model.dsa), read in place from the
paged latent cache. The CPU kernel (densa.kernels.cpu.sparse_latent_decode) computes the same;
the torch reference is densa.model.latent_attention's _torch_sparse_decode.

    for each sequence b, its selected positions p_1..p_k (-1: none):
        row_j  = latent[page_table[b, p_j // S], 0, p_j % S]      [r | rope]
        s[h,j] = (q_lat[b,h] . row_j[:r] + q_rope[b,h] . row_j[r:]) * sm_scale * scale_j
        out[b, h] = sum_j softmax_j(s[h]) scale_j row_j[:r]       the latent doubles as V

Stage 1, one program per (sequence, block of BLOCK_H heads, split of the k selected rows): the
heads' queries are the rows of a [BLOCK_H, r] and a [BLOCK_H, rope] tile (the latent and rope
parts kept apart, so r = 512 and rope = 64 are padded to no wider power of two than their own),
and the split's positions are walked BLOCK_N at a time:

    pos [BLOCK_N] from the index list (-1, or a position past the page table: masked out)
    page = page_table[b, pos // S], slot = pos % S                  gathered where they lie
    scores [BLOCK_H, BLOCK_N] = q_lat @ c^T + q_rope @ k_rope^T, times the rows' FP8 scales
    online softmax (base 2); acc [BLOCK_H, r] += (p * scale) @ c    c: the same tile, reused

Every head of the block reads a selected row once. Per-row FP8 scales are applied to the score
and probability tiles, as densa.kernels.triton.decode_attention does (they factor out of the dot
over the row). Stage 2 is decode_attention's merge of the splits' partial outputs and
log-sum-exps; a sequence with no valid position (a padding row) gets zeros.

Nothing reads a tensor's values on the host: the grid comes from the shapes (B, heads, k), so
the call can be captured in a CUDA graph and replayed with new selections.
"""

from __future__ import annotations

import math

import torch

from densa.formats.kv_format import KVFormat
from densa.kernels.triton.common import (
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
    from densa.kernels.triton.decode_attention import _decode_merge_kernel

    @triton.jit
    def _sparse_split_kernel(
        q_ptr, latent_ptr, scale_ptr, table_ptr, pos_ptr,
        part_out_ptr, part_lse_ptr,
        qk_factor, rows_per_split, num_rows, max_pos,
        stride_qb, stride_qh,
        stride_cp, stride_cs,
        stride_sp,
        stride_tb, stride_pb,
        stride_ob, stride_oh, stride_os,
        NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
        RANK: tl.constexpr, BLOCK_R: tl.constexpr,
        ROPE: tl.constexpr, BLOCK_E: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
        SCALES: tl.constexpr, WIDEN: tl.constexpr,
    ):  # fmt: skip
        seq, head_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = split * rows_per_split
        end = tl.minimum(start + rows_per_split, num_rows)
        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < NUM_HEADS
        dims = tl.arange(0, BLOCK_R)
        dim_ok = dims < RANK
        q_row = q_ptr + seq * stride_qb + heads[:, None] * stride_qh  # [BLOCK_H, 1]
        q_lat = tl.load(
            q_row + dims[None, :], mask=head_ok[:, None] & dim_ok[None, :], other=0.0
        )  # [BLOCK_H, BLOCK_R]
        if ROPE > 0:
            rope = tl.arange(0, BLOCK_E)
            rope_ok = rope < ROPE
            q_rope = tl.load(
                q_row + RANK + rope[None, :], mask=head_ok[:, None] & rope_ok[None, :], other=0.0
            )  # [BLOCK_H, BLOCK_E]
        factor = qk_factor  # sm_scale * log2(e), times a static scale
        if SCALES == 1:
            factor = factor * tl.load(scale_ptr)
        run_max = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        run_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
        for block_start in range(start, end, BLOCK_N):
            j = block_start + tl.arange(0, BLOCK_N)
            pos = tl.load(pos_ptr + seq * stride_pb + j, mask=j < end, other=-1).to(tl.int64)
            ok = (pos >= 0) & (pos < max_pos)  # -1 padding (and anything past the table): none
            pos = tl.where(ok, pos, 0)
            page = tl.load(table_ptr + seq * stride_tb + pos // PAGE_SIZE, mask=ok, other=0)
            ok = ok & (page >= 0)
            page = tl.where(ok, page, 0).to(tl.int64)
            slot = pos % PAGE_SIZE
            row = latent_ptr + page * stride_cp + slot * stride_cs  # [BLOCK_N]
            c = tl.load(row[:, None] + dims[None, :], mask=ok[:, None] & dim_ok[None, :], other=0.0)
            c = c.to(q_lat.dtype)  # [BLOCK_N, BLOCK_R]: keys' latent part, and the values
            scores = mma(q_lat, tl.trans(c), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), WIDEN)
            if ROPE > 0:
                k_rope = tl.load(
                    row[:, None] + RANK + rope[None, :],
                    mask=ok[:, None] & rope_ok[None, :],
                    other=0.0,
                )  # [BLOCK_N, BLOCK_E]
                scores = mma(q_rope, tl.trans(k_rope.to(q_rope.dtype)), scores, WIDEN)
            scores = scores * factor
            if SCALES >= 2:
                row_scale = token_scales(scale_ptr, page * stride_sp + slot, ok, SCALES)
                scores = scores * row_scale[None, :]
            scores = tl.where(ok[None, :], scores, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(scores, axis=1))
            alpha = tl.exp2(run_max - new_max)
            probs = tl.exp2(scores - new_max[:, None])  # [BLOCK_H, BLOCK_N]
            run_sum = run_sum * alpha + tl.sum(probs, axis=1)
            if SCALES >= 2:
                probs = probs * row_scale[None, :]
            acc = mma(probs.to(q_lat.dtype), c, acc * alpha[:, None], WIDEN)
            run_max = new_max
        has_rows = run_sum > 0
        safe_sum = tl.where(has_rows, run_sum, 1.0)
        out = acc / safe_sum[:, None]
        if SCALES == 1:
            out = out * tl.load(scale_ptr)
        lse = tl.where(has_rows, run_max + tl.log2(safe_sum), float("-inf"))
        base = seq * stride_ob + heads * stride_oh + split * stride_os  # [BLOCK_H]
        tl.store(
            part_out_ptr + base[:, None] + dims[None, :],
            out,
            mask=head_ok[:, None] & dim_ok[None, :],
        )
        # part_lse is part_out without its last dimension: the same index divided by RANK.
        tl.store(part_lse_ptr + base // RANK, lse, mask=head_ok)


MAX_SPLITS = 64
HEADS_PER_PROGRAM = 16  # the tensor cores' smallest M: a [16, r] query tile per program


def block_rows(kv_lora_rank: int) -> int:
    """Selected rows per stage-1 step: a [BLOCK_N, r] latent tile stays around 32 KiB in 16-bit."""
    return 32 if kv_lora_rank >= 256 else 64


def choose_num_splits(num_programs: int, num_rows: int, block_n: int, device: torch.device) -> int:
    """Enough splits of the k selected rows that stage 1 has ~2 programs per multiprocessor,
    none shorter than a block of rows. num_programs: (sequence, head block) pairs."""
    wanted = math.ceil(2 * multiprocessors(device) / max(1, num_programs))
    max_useful = max(1, math.ceil(num_rows / block_n))
    return max(1, min(wanted, max_useful, MAX_SPLITS))


def sparse_latent_decode(
    query: torch.Tensor,
    latent: torch.Tensor,
    page_table: torch.Tensor,
    positions: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    latent_scale: torch.Tensor | None = None,
    kv_format: KVFormat | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """query [B, H, r + rope] (q_lat | q_rope, one token per sequence); latent pages
    [P, 1, S, r + rope] in BF16/FP16/FP32 or FP8 (their scales in `latent_scale`: a 0-dim
    static scale or per-row [P, 1, S] int8 exponents / float32); page_table int32 [B, max_pages];
    positions [B, k] within each sequence (-1: none) -> [B, H, r] in query's dtype.

    A position outside the sequence's page table reads nothing (as -1 does); the caller's
    positions should lie below each sequence's length, as the indexer's do.
    """
    require_triton()
    num_seqs, num_heads, dim = query.shape
    if latent.dim() != 4 or latent.shape[1] != 1 or latent.shape[3] != dim:
        raise ValueError("latent pages must be [pages, 1, page_size, kv_lora_rank + rope]")
    if positions.dim() != 2 or positions.shape[0] != num_seqs or page_table.shape[0] != num_seqs:
        raise ValueError("query / page_table / positions disagree on the batch")
    if not 0 < kv_lora_rank <= dim:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} does not fit rows of {dim} values")
    if query.stride(-1) != 1 or latent.stride(-1) != 1 or positions.stride(-1) != 1:
        raise ValueError("query, latent pages and positions need a contiguous last dimension")
    page_size, num_rows = latent.shape[2], positions.shape[1]
    out = query.new_empty(num_seqs, num_heads, kv_lora_rank)
    if num_seqs == 0 or num_heads == 0 or num_rows == 0:
        return out.zero_()
    rope = dim - kv_lora_rank
    block_h = HEADS_PER_PROGRAM
    head_blocks = math.ceil(num_heads / block_h)
    block_n = block_n or block_rows(kv_lora_rank)
    splits = num_splits or choose_num_splits(
        num_seqs * head_blocks, num_rows, block_n, query.device
    )
    rows_per_split = math.ceil(math.ceil(num_rows / splits) / block_n) * block_n
    splits = math.ceil(num_rows / rows_per_split)  # none left without rows
    # [B, H, splits, r] partial outputs, and their log-sum-exps laid out as [B, H, splits].
    part_out = torch.empty(
        num_seqs, num_heads, splits, kv_lora_rank, dtype=torch.float32, device=query.device
    )
    part_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=query.device)
    stride_sp, _ = token_scale_strides(latent_scale)
    _sparse_split_kernel[(num_seqs, head_blocks, splits)](
        query, latent, or_dummy(latent_scale, query), page_table, positions,
        part_out, part_lse,
        sm_scale * math.log2(math.e), rows_per_split, num_rows, page_table.shape[1] * page_size,
        query.stride(0), query.stride(1),
        latent.stride(0), latent.stride(2),
        stride_sp,
        page_table.stride(0), positions.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        NUM_HEADS=num_heads, BLOCK_H=block_h,
        RANK=kv_lora_rank, BLOCK_R=max(16, next_power_of_2(kv_lora_rank)),
        ROPE=rope, BLOCK_E=max(16, next_power_of_2(rope)),
        PAGE_SIZE=page_size, BLOCK_N=block_n,
        SCALES=scale_mode(latent_scale, kv_format), WIDEN=interpreting(),
    )  # fmt: skip
    _decode_merge_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out,
        splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        out.stride(0), out.stride(1),
        HEAD_DIM=kv_lora_rank, BLOCK_D=next_power_of_2(kv_lora_rank),
        BLOCK_S=next_power_of_2(splits),
    )  # fmt: skip
    return out
