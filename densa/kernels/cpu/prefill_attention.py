"""Chunked-prefill attention on the CPU: gather the few prefill sequences' pages, widen them to
float32 and run one masked SDPA call (prefill is compute-bound; SDPA's matmuls beat a custom
kernel here). Layout, scales and GQA follow `paged_attention_ref`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from densa.formats.kv_format import KVFormat, is_layer_scale
from densa.kernels.reference.paged_attention import scale_to_float


def _gather_dense(
    cache: torch.Tensor,
    pages: torch.Tensor,
    scale: torch.Tensor | None,
    valid: torch.Tensor,
    kv_format: KVFormat | None,
) -> torch.Tensor:
    """Widened, scaled K or V of B sequences, padded to whole pages: float32 [B, Hkv, n*S, D].

    pages: int64 [B, n]; valid: bool [B, 1, n*S, 1], True for positions < seq_len. Positions past
    seq_len (stale or never-written slots, possibly NaN bit patterns) are zeroed, because SDPA's
    mask does not stop NaN in masked K/V from poisoning the row (NaN * 0 = NaN).
    """
    num_pages, num_kv_heads, page_size, head_dim = cache.shape
    batch, n = pages.shape
    # One gather straight into [B, Hkv, n, S, D] order: index pages*Hkv + head of the
    # [P*Hkv, S, D] view, so each head's pages come out contiguous without a permute copy.
    heads = torch.arange(num_kv_heads).view(1, num_kv_heads, 1)
    index = (pages.unsqueeze(1) * num_kv_heads + heads).reshape(-1)
    blocks = cache.view(num_pages * num_kv_heads, page_size, head_dim)[index]
    dense = blocks.to(torch.float32).view(batch, num_kv_heads, n * page_size, head_dim)
    if scale is not None:
        if is_layer_scale(scale, kv_format):
            dense.mul_(scale.to(torch.float32))
        else:
            per_token = scale.reshape(num_pages * num_kv_heads, page_size)[index]
            dense.mul_(scale_to_float(per_token).view(batch, num_kv_heads, -1, 1))
    return dense.masked_fill_(~valid, 0.0)


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
    kv_format: KVFormat | None = None,
) -> torch.Tensor:
    """Causal attention for chunked prefill (any query_len >= 1), via one batched SDPA call.

    query: float32 [total_q, H, D], sequence i owning query_lens[i] consecutive rows whose
    absolute positions are seq_lens[i] - query_lens[i] + j. Returns float32 [total_q, H, D].
    The B sequences are gathered, widened and padded to a common length; an explicit boolean
    causal-with-offset mask hides padding and the future.
    new_kv: optional (k, v) [total_q, Hkv, D] of the query rows before they were quantized into
    the cache; attention then reads them instead of their cached copies (see the reference).
    """
    total_q, num_heads, head_dim = query.shape
    batch = page_table.shape[0]
    page_size = k_cache.shape[2]
    seq_lens = seq_lens.to(torch.int64)
    query_lens = query_lens.to(torch.int64)
    max_q = int(query_lens.max())
    num_pages = (int(seq_lens.max()) + page_size - 1) // page_size
    pages = page_table[:, :num_pages].to(torch.int64)

    key_pos = torch.arange(num_pages * page_size)
    valid = (key_pos < seq_lens.view(batch, 1)).view(batch, 1, -1, 1)
    k = _gather_dense(k_cache, pages, k_scale, valid, kv_format)
    v = _gather_dense(v_cache, pages, v_scale, valid, kv_format)

    # Row r of `query` is new token j of sequence seq[r]; padded slot (b, j) holds it.
    seq = torch.repeat_interleave(torch.arange(batch), query_lens, output_size=total_q)
    starts = torch.cumsum(query_lens, 0) - query_lens
    j = torch.arange(total_q) - starts[seq]
    if new_kv is not None:
        pos = (seq_lens - query_lens)[seq] + j  # absolute position of each query row
        k[seq, :, pos] = new_kv[0].to(torch.float32)
        v[seq, :, pos] = new_kv[1].to(torch.float32)
    if total_q == batch * max_q:  # all chunks equally long: the padded layout is a free view
        q = query.view(batch, max_q, num_heads, head_dim)
    else:
        q = query.new_zeros((batch, max_q, num_heads, head_dim))
        q[seq, j] = query
    # Padded query rows (j >= query_len) get positions >= seq_len; they attend to real keys, so
    # no row is fully masked (which would produce NaN), and their output is dropped below.
    q_pos = (seq_lens - query_lens).view(batch, 1) + torch.arange(max_q)
    mask = key_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)
    mask = (mask & valid.view(batch, 1, -1)).unsqueeze(1)  # [B, 1, max_q, n*S]

    out = F.scaled_dot_product_attention(
        q.to(torch.float32).transpose(1, 2), k, v, attn_mask=mask, scale=sm_scale, enable_gqa=True
    )  # [B, H, max_q, D]
    out = out.transpose(1, 2)
    if total_q == batch * max_q:
        return out.reshape(total_q, num_heads, head_dim)
    return out[seq, j]
