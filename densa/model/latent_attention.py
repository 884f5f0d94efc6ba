"""Paged attention over MLA latent pages (DeepSeek-V2, sec. 2.1; DeepSeek-V3).

Per token and layer the cache holds one latent row [c_kv | k_rope] (kv_lora_rank + rope_dim
values, densa.model.kv_layout.LatentKVCache). Keys and values of every head are linear in c_kv:

    k_nope[h] = W_uk[h] c_kv        v[h] = W_uv[h] c_kv        (W_uk, W_uv: rows of kv_b_proj)
    score[h]  = q_nope[h] . k_nope[h] + q_rope[h] . k_rope
              = (W_uk[h]^T q_nope[h]) . c_kv + q_rope[h] . k_rope

Two ways to attend, with the same result:
- expanded (prefill): decompress the context's k_nope and v per head with kv_b_proj, then
  ordinary multi-head attention (head dims nope + rope and v); compute-bound prompts prefer it;
- absorbed (decode): fold W_uk into the query (q_lat = W_uk^T q_nope, one [kv_lora_rank] row per
  head) and W_uv into the output, so attention is multi-query over the latent pages themselves:
  one "KV head" of kv_lora_rank + rope_dim values, the latent doubling as the value (its first
  kv_lora_rank entries). Nothing is decompressed; decode reads only the compressed cache, and on
  the CPU it runs through the same fused paged kernel as dense decode.

Sparse attention (DSA, densa.model.dsa) restricts each query to its top-k tokens: prefill adds
the selection to the expanded path's mask; decode gathers only the selected latent rows
(`sparse_absorbed_decode`), so a step reads k rows per sequence and layer, not the context:
in place, by a fused kernel, on the CPU (Numba) and the Triton backends; by gathering them
first elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from densa.formats.kv_format import is_layer_scale
from densa.kernels.cpu.kv_store import store_kv
from densa.model.attention import (
    AttentionGroup,
    AttentionMetadata,
    gather_dequantized,
    query_positions,
)
from densa.model.kv_layout import LatentKVCache


def store_latent(cache: LatentKVCache, latent: torch.Tensor, meta: AttentionMetadata) -> None:
    """Write this step's latent rows [T, kv_lora_rank + rope] into their slots (quantized as
    the cache's format says: FP8 with one power-of-two scale per row when dynamic, INT8)."""
    rows = latent.unsqueeze(1)  # [T, 1, D]: one "head" per token, like a K/V page row
    store_kv(cache.kv_format, cache.latent, cache.scale, meta.slot_pages, meta.slot_offsets, rows)


def gather_latent(cache: LatentKVCache, group: AttentionGroup, dtype: torch.dtype) -> torch.Tensor:
    """The group's latent rows, padded to whole pages: [B, max_pages * page_size, D]."""
    return gather_dequantized(cache.latent, cache.scale, group.page_table, dtype)[:, 0]


def absorbed_decode(
    q_latent: torch.Tensor,
    cache: LatentKVCache,
    group: AttentionGroup,
    scale: float,
    kv_lora_rank: int,
    backend_name: str,
) -> torch.Tensor:
    """q_latent: [B, H, kv_lora_rank + rope] (q_lat | q_rope), one query per sequence ->
    attention-weighted latents [B, H, kv_lora_rank], by the backend's kernel."""
    decode = _ABSORBED_DECODE.get(backend_name, _torch_absorbed_decode)
    return decode(q_latent, cache, group, scale, kv_lora_rank)


def _torch_absorbed_decode(
    q_latent: torch.Tensor,
    cache: LatentKVCache,
    group: AttentionGroup,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    latent = gather_latent(cache, group, q_latent.dtype).unsqueeze(1)  # [B, 1, K, D]
    out = F.scaled_dot_product_attention(
        q_latent.unsqueeze(2),
        latent,
        latent[..., :kv_lora_rank],
        attn_mask=group.mask,
        scale=scale,
        enable_gqa=True,
    )  # fmt: skip  -> [B, H, 1, r]
    return out[:, :, 0]


def _cpu_absorbed_decode(
    q_latent: torch.Tensor,
    cache: LatentKVCache,
    group: AttentionGroup,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """The fused paged decode kernel with the latent pages as both K and V (one KV head); the
    output's trailing rope entries are the value's unused part, dropped."""
    from densa.kernels.cpu import paged_attention as kernels

    out = kernels.paged_decode_attention(
        q_latent.float().contiguous(), cache.latent, cache.latent, group.page_table,
        group.seq_lens, scale, cache.scale, cache.scale,
    )  # fmt: skip
    return out[..., :kv_lora_rank].to(q_latent.dtype)


# Absorbed decode kernels by attention backend name (others use the torch path).
_ABSORBED_DECODE = {"torch": _torch_absorbed_decode, "cpu": _cpu_absorbed_decode}


def sparse_absorbed_decode(
    q_latent: torch.Tensor,
    cache: LatentKVCache,
    group: AttentionGroup,
    positions: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    backend_name: str,
) -> torch.Tensor:
    """Absorbed decode over each sequence's selected tokens only, by the backend's kernel.
    q_latent: [B, H, r + rope]; positions: [B, k] within each sequence (-1: none) -> [B, H, r]."""
    decode = _SPARSE_DECODE.get(backend_name, _torch_sparse_decode)
    return decode(q_latent, cache, group, positions, scale, kv_lora_rank)


def _torch_sparse_decode(
    q_latent: torch.Tensor,
    cache: LatentKVCache,
    group: AttentionGroup,
    positions: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    rows = gather_latent_rows(cache, group.page_table, positions, q_latent.dtype)  # [B, k, D]
    latent = rows.unsqueeze(1)  # [B, 1, k, D]: one "KV head"
    out = F.scaled_dot_product_attention(
        q_latent.unsqueeze(2),
        latent,
        latent[..., :kv_lora_rank],
        attn_mask=(positions >= 0)[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )  # fmt: skip  -> [B, H, 1, r]
    return out[:, :, 0]


def _cpu_sparse_decode(
    q_latent: torch.Tensor,
    cache: LatentKVCache,
    group: AttentionGroup,
    positions: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """The fused kernel: reads only the selected rows, in place (densa.kernels.cpu)."""
    from densa.kernels.cpu.sparse_latent_decode import sparse_latent_decode

    out = sparse_latent_decode(
        q_latent.float().contiguous(), cache.latent, group.page_table, positions, scale,
        kv_lora_rank, cache.scale, cache.kv_format,
    )  # fmt: skip
    return out.to(q_latent.dtype)


def _triton_sparse_decode(
    q_latent: torch.Tensor,
    cache: LatentKVCache,
    group: AttentionGroup,
    positions: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """The Triton kernel: reads only the selected rows, in place, with no host sync (so the
    decode step stays graph-capturable; densa.kernels.triton.sparse_latent_decode)."""
    from densa.kernels.triton.sparse_latent_decode import sparse_latent_decode

    return sparse_latent_decode(
        q_latent.contiguous(), cache.latent, group.page_table, positions.contiguous(), scale,
        kv_lora_rank, cache.scale, cache.kv_format,
    )  # fmt: skip


# Sparse decode kernels by attention backend name (others use the torch path).
_SPARSE_DECODE = {
    "torch": _torch_sparse_decode,
    "cpu": _cpu_sparse_decode,
    "triton": _triton_sparse_decode,
}


def gather_latent_rows(
    cache: LatentKVCache, page_table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The latent rows at `positions` [B, k] of each sequence, dequantized: [B, k, D] (a -1
    reads the sequence's first row, for the caller to mask)."""
    pos = positions.clamp(min=0)
    pages = page_table.long().gather(1, pos // cache.page_size)  # [B, k]
    slots = pos % cache.page_size
    values = cache.latent[pages, 0, slots]  # [B, k, D]
    scale = cache.scale
    if scale is not None and not is_layer_scale(scale, cache.kv_format):
        scale = scale[pages, 0, slots]  # [B, k]: one per row
    return cache.kv_format.dequantize(values, scale).to(dtype)


def expanded_prefill(
    q: torch.Tensor,
    cache: LatentKVCache,
    group: AttentionGroup,
    scale: float,
    decompress: torch.nn.Module,
    dims: tuple[int, int, int],
    new_latent: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [rows, H, nope + rope] -> [rows, H, v_dim]. decompress: kv_b_proj, [.., kv_lora_rank]
    -> [.., H * (nope + v)]. dims: (kv_lora_rank, nope, v). new_latent: the group's own rows as
    computed ([rows, D]); when given (FP8 pages) they replace their quantized copies. mask: the
    keys each query attends ([B, 1, max_q, K] bool), when not the group's causal mask (DSA)."""
    kv_lora_rank, nope, v_dim = dims
    num_heads = q.shape[1]
    latent = gather_latent(cache, group, q.dtype)  # [B, K, D]
    if new_latent is not None:
        seq, pos = query_positions(group)
        latent[seq, pos] = new_latent.to(latent.dtype)
    num_seqs, num_keys, _ = latent.shape
    kv = decompress(latent[..., :kv_lora_rank].reshape(num_seqs * num_keys, kv_lora_rank))
    kv = kv.view(num_seqs, num_keys, num_heads, nope + v_dim).transpose(1, 2)  # [B, H, K, n+v]
    k_nope, values = kv.split([nope, v_dim], dim=-1)
    k_rope = latent[:, None, :, kv_lora_rank:].expand(-1, num_heads, -1, -1)  # shared by heads
    keys = torch.cat([k_nope, k_rope], dim=-1)  # [B, H, K, nope + rope]
    q_pad = q.new_zeros(num_seqs * group.max_query_len, num_heads, q.shape[2])
    q_pad[group.valid] = q
    q_pad = q_pad.view(num_seqs, group.max_query_len, num_heads, -1).transpose(1, 2)
    attend = group.mask if mask is None else mask
    out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=attend, scale=scale)
    out = out.transpose(1, 2).reshape(num_seqs * group.max_query_len, num_heads, v_dim)
    return out[group.valid]
