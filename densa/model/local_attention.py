"""Sliding-window ("local") paged attention: a query at position p sees keys p - window + 1 .. p.

Gemma 3 interleaves local layers (window 512 for the 270M model) with global ones; Mistral
slides in every layer. All layers share one page table, so a local layer's pages are the same
pages a global layer uses (no memory is saved: a known limit, see docs/models.md); what the window
changes is which keys are read.

While no sequence of a group has outgrown the window, the window hides nothing, and the group
goes through the backend's ordinary (fused) kernels. Otherwise each sequence reads only the pages
its queries can see -- the window's worth, not the whole context -- through one masked SDPA:

    positions      0 ........ lo ............. seq_len - q_len ...... seq_len - 1
    pages read          [first_page * P ............................... last page]
    visible keys             (q_pos - window, q_pos]   for each query position q_pos
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from densa.model.attention import (
    AttentionBackend,
    AttentionGroup,
    AttentionMetadata,
    LayerKVCache,
    gather_dequantized,
    paged_attention,
    query_positions,
)


def paged_attention_in_window(
    backend: AttentionBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KVH, D] -> [T, H, D]; global attention when window is None."""
    if window is None or not _outgrows(meta, window):
        return paged_attention(backend, q, k, v, cache, meta, scale)
    backend.store_kv(cache, k, v, meta)
    fresh_prefill = cache.kv_format.is_quantized  # prefill reads its own K/V unquantized
    out = torch.empty_like(q)
    for group in (meta.decode, meta.prefill):
        if group is None:
            continue
        rows = slice(group.start, group.end)
        new_kv = (k[rows], v[rows]) if fresh_prefill and group is meta.prefill else None
        out[rows] = attend_window(q[rows], cache, group, scale, window, new_kv)
    return out


def _outgrows(meta: AttentionMetadata, window: int) -> bool:
    groups = [g for g in (meta.decode, meta.prefill) if g is not None]
    return any(int(g.seq_lens.max()) > window for g in groups)


def attend_window(
    q: torch.Tensor,
    cache: LayerKVCache,
    group: AttentionGroup,
    scale: float,
    window: int | None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One group's local attention (global when window is None). q: [rows, H, D] -> [rows, H,
    D] in q's dtype. `sinks` [H]: a learned logit per head that joins each softmax's
    denominator and adds nothing to its output (gpt-oss), as a key of score sinks[h] and value
    0: one more key slot whose mask entry is the sink."""
    page_size = cache.page_size
    seq_lens, query_lens = group.seq_lens.long(), group.query_lens.long()
    # The earliest key any of a sequence's queries sees, rounded down to its page.
    reach = seq_lens if window is None else torch.full_like(seq_lens, window - 1) + query_lens
    first_page = (seq_lens - reach).clamp(min=0) // page_size  # [B]
    num_pages = -(-seq_lens // page_size) - first_page  # [B] pages from there to the end
    max_pages = int(num_pages.max())
    page_idx = first_page[:, None] + torch.arange(max_pages)  # [B, max_pages]
    in_range = torch.arange(max_pages)[None, :] < num_pages[:, None]
    table = torch.gather(group.page_table.long(), 1, torch.where(in_range, page_idx, 0))
    table = torch.where(in_range, table, table[:, :1])  # padding: any valid page, masked below
    k_all = gather_dequantized(cache.k, cache.k_scale, table, q.dtype)  # [B, KVH, K, D]
    v_all = gather_dequantized(cache.v, cache.v_scale, table, q.dtype)
    key_pos = first_page[:, None] * page_size + torch.arange(max_pages * page_size)  # [B, K]
    seq, q_pos = query_positions(group)  # per row: its sequence and absolute position
    if new_kv is not None:  # the group's own positions, as computed (not the FP8 copies)
        slot = q_pos - first_page[seq] * page_size
        k_all[seq, :, slot] = new_kv[0].to(k_all.dtype)
        v_all[seq, :, slot] = new_kv[1].to(v_all.dtype)
    q_pad, q_pos_pad = _pad_queries(q, group, seq, q_pos)  # [B, H, Q, D], [B, Q]
    visible = key_pos[:, None, :] <= q_pos_pad[:, :, None]  # [B, Q, K]
    if window is not None:
        visible &= key_pos[:, None, :] > q_pos_pad[:, :, None] - window
    mask: torch.Tensor = visible.unsqueeze(1)  # [B, 1, Q, K]
    if sinks is not None:
        k_all, v_all, mask = _with_sink_slot(k_all, v_all, mask, sinks, q_pad.dtype)
    out = F.scaled_dot_product_attention(
        q_pad, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=True
    )  # [B, H, Q, D]
    num_seqs, num_heads, max_q, head_dim = out.shape
    return out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)[group.valid]


def _with_sink_slot(
    k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v [B, KVH, K, D] + one zero key and value; the boolean mask [B, 1, Q, K] as additive
    scores [B, H, Q, K + 1]: 0 where visible, -inf elsewhere, the head's sink in the new slot
    (q . 0 = 0, so its score is the sink itself, and its value adds nothing)."""
    zeros = k.new_zeros(*k.shape[:2], 1, k.shape[3])
    k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
    num_seqs, _, num_queries, _ = visible.shape
    scores = k.new_zeros(visible.shape, dtype=dtype).masked_fill(~visible, float("-inf"))
    sink = sinks.to(dtype).view(1, -1, 1, 1).expand(num_seqs, -1, num_queries, 1)
    return k, v, torch.cat([scores.expand(-1, sink.shape[1], -1, -1), sink], dim=-1)


def _pad_queries(
    q: torch.Tensor, group: AttentionGroup, seq: torch.Tensor, q_pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, H, D] -> [B, H, max_q, D], and each padded slot's position; a padding slot takes
    its sequence's last position, so it sees real keys (no all-masked row, no NaN)."""
    num_seqs, max_q = group.num_seqs, group.max_query_len
    num_heads, head_dim = q.shape[1], q.shape[2]
    q_pad = q.new_zeros(num_seqs * max_q, num_heads, head_dim)
    q_pad[group.valid] = q
    pos_pad = (group.seq_lens.long() - 1).repeat_interleave(max_q)  # [B * max_q]
    pos_pad[group.valid] = q_pos
    q_pad = q_pad.view(num_seqs, max_q, num_heads, head_dim).transpose(1, 2)
    return q_pad, pos_pad.view(num_seqs, max_q)
