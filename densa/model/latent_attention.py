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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def expanded_prefill(
    q: torch.Tensor,
    cache: LatentKVCache,
    group: AttentionGroup,
    scale: float,
    decompress: torch.nn.Module,
    dims: tuple[int, int, int],
    new_latent: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [rows, H, nope + rope] -> [rows, H, v_dim]. decompress: kv_b_proj, [.., kv_lora_rank]
    -> [.., H * (nope + v)]. dims: (kv_lora_rank, nope, v). new_latent: the group's own rows as
    computed ([rows, D]); when given (FP8 pages) they replace their quantized copies."""
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
    out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=group.mask, scale=scale)
    out = out.transpose(1, 2).reshape(num_seqs * group.max_query_len, num_heads, v_dim)
    return out[group.valid]
