"""Slow, obviously-correct paged attention in plain torch, plus cache-writing helpers for tests.

Layout shared by every kernel in this package:

    k_cache, v_cache  [num_pages, num_kv_heads, page_size, head_dim], dtype float32 / bfloat16 /
                      float16 / float8_e4m3fn. Head-major inside a page, so one head's page is one
                      contiguous page_size x head_dim block.
    k_scale, v_scale  None (means 1.0), a 0-dim float32 tensor (static per-layer scale), or a
                      [num_pages, num_kv_heads, page_size] tensor (dynamic per-token-and-head scale)
                      of float32 scales or of int8 power-of-two exponents e (scale = 2**e, e in
                      [-126, 119]; one byte instead of four, see densa.formats.fp8_kv).
                      Dequantized value = cache_value.float() * scale. Meant for fp8 caches, but
                      applied the same way for any dtype.
    page_table        int32 [B, max_pages]; token position p of sequence i lives in page
                      page_table[i, p // page_size], slot p % page_size. Padding entries must still
                      be valid page ids.
    seq_lens          int32 [B], context length INCLUDING the new tokens (already written to cache).
    query_lens        int32 [B], number of new tokens of each sequence.

GQA: query head h reads kv head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

import torch

from densa.formats.fp8_kv import (
    EXPONENT_SCALE_DTYPE,
    FP8_DTYPE,
    quantize_fp8,
    quantize_fp8_exponent,
)
from densa.formats.kv_format import is_layer_scale


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32 multipliers: int8 exponents e become 2**e, float scales pass through."""
    if scale.dtype == EXPONENT_SCALE_DTYPE:
        return torch.exp2(scale.to(torch.float32))
    return scale.to(torch.float32)


def dequantize_pages(
    cache: torch.Tensor, pages: torch.Tensor, scale: torch.Tensor | None
) -> torch.Tensor:
    """Widen `cache[pages]` to float32 and apply `scale`.

    cache: [num_pages, Hkv, S, D]; pages: int [n]. Returns float32 [n, Hkv, S, D].
    """
    values = cache[pages.long()].to(torch.float32)
    if scale is None:
        return values
    if is_layer_scale(scale, None):
        return values * scale.to(torch.float32)
    return values * scale_to_float(scale[pages.long()]).unsqueeze(-1)


def gather_sequence_kv(
    cache: torch.Tensor, page_row: torch.Tensor, seq_len: int, scale: torch.Tensor | None
) -> torch.Tensor:
    """Dense float32 K or V of one sequence: [Hkv, seq_len, D], positions in order."""
    page_size = cache.shape[2]
    num_pages = (seq_len + page_size - 1) // page_size
    blocks = dequantize_pages(cache, page_row[:num_pages], scale)  # [n, Hkv, S, D]
    dense = blocks.permute(1, 0, 2, 3).reshape(cache.shape[1], num_pages * page_size, -1)
    return dense[:, :seq_len]


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """Textbook attention of the LAST q_len positions of one sequence over all its positions.

    q: [q_len, H, D]; k, v: [Hkv, L, D] (L >= q_len). Returns float32 [q_len, H, D].
    """
    q_len, num_heads, _ = q.shape
    seq_len = k.shape[1]
    group = num_heads // k.shape[0]
    k = k.repeat_interleave(group, dim=0)  # [H, L, D]
    v = v.repeat_interleave(group, dim=0)
    scores = torch.einsum("qhd,hkd->hqk", q.to(torch.float32), k) * sm_scale
    q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
    k_pos = torch.arange(seq_len).unsqueeze(0)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,hkd->qhd", probs, v)


def paged_attention_reference(
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
    """Causal paged attention, one sequence at a time.

    query: float32 [total_q, H, D], the new tokens of B sequences concatenated (sequence i owns
    query_lens[i] consecutive rows). The j-th new token of sequence i sits at absolute position
    seq_lens[i] - query_lens[i] + j and attends to positions 0..that position.
    new_kv: optional (k, v) [total_q, Hkv, D], the new tokens' K/V before they were quantized
    into the cache. When given, the new positions are read from them (high precision) and only
    the earlier context from the cache: prefill attends to its own chunk unquantized.
    Returns float32 [total_q, H, D].
    """
    out = torch.empty(query.shape, dtype=torch.float32)
    start = 0
    for i in range(page_table.shape[0]):
        seq_len, q_len = int(seq_lens[i]), int(query_lens[i])
        k = gather_sequence_kv(k_cache, page_table[i], seq_len, k_scale)
        v = gather_sequence_kv(v_cache, page_table[i], seq_len, v_scale)
        rows = slice(start, start + q_len)
        if new_kv is not None:  # [q_len, Hkv, D] -> positions seq_len - q_len .. seq_len - 1
            k[:, seq_len - q_len :] = new_kv[0][rows].to(torch.float32).transpose(0, 1)
            v[:, seq_len - q_len :] = new_kv[1][rows].to(torch.float32).transpose(0, 1)
        out[rows] = dense_causal_attention(query[rows], k, v, sm_scale)
        start += q_len
    return out


# ---- cache writing (tests, benchmarks) ---------------------------------------------------------


def write_kv_reference(
    cache: torch.Tensor,
    page_row: torch.Tensor,
    start_pos: int,
    values: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> None:
    """Store values [n, Hkv, D] (float32) at positions start_pos..start_pos+n-1 of one sequence.

    cache: [num_pages, Hkv, S, D] of any supported dtype; page_row: int [max_pages].
    For an fp8 cache: `scale` None means scale 1.0, a 0-dim tensor is a static scale, and a
    [num_pages, Hkv, S] tensor is filled in place with dynamic per-token-head scales: float32
    amax / 448, or int8 power-of-two exponents (`quantize_fp8_exponent`).
    For an int8 cache `scale` is its [num_pages, Hkv, S] fp16 row-scale tensor (filled here).
    For other dtypes values are simply cast (scale must be None).
    """
    page_size = cache.shape[2]
    pos = torch.arange(start_pos, start_pos + values.shape[0])
    pages = page_row.long()[pos // page_size]
    slots = pos % page_size
    if cache.dtype == torch.int8:  # INT8 KV: codes + one fp16 scale per row (formats.int8_kv)
        from densa.formats.int8_kv import quantize_rows

        if scale is None:
            raise ValueError("int8 caches need their fp16 row-scale tensor")
        codes, row_scale = quantize_rows(values)
        cache[pages, :, slots] = codes
        scale[pages, :, slots] = row_scale
        return
    if cache.dtype != FP8_DTYPE:
        if scale is not None:
            raise ValueError("scales are only produced for float8 caches")
        stored = values.to(cache.dtype)
    elif scale is None or is_layer_scale(scale, None):
        stored, _ = quantize_fp8(values, torch.tensor(1.0) if scale is None else scale)
    elif scale.dtype == EXPONENT_SCALE_DTYPE:
        stored, exponents = quantize_fp8_exponent(values)
        scale[pages, :, slots] = exponents
    else:
        stored, token_scale = quantize_fp8(values)  # token_scale: [n, Hkv]
        scale[pages, :, slots] = token_scale
    cache[pages, :, slots] = stored
