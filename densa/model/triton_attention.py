"""The GPU attention backend: densa's Triton kernels for every group of a step.

    store_kv   one Triton launch per K and per V: cast, or quantize to FP8 with scales, and
               scatter into the page slots (densa.kernels.triton_kv_store)
    decode     split-K paged decode attention over the pages in place (triton_decode_attention)
    prefill    paged varlen causal attention, earlier context from the pages, the chunk itself
               from the pages or, for FP8 pages, from its own K/V as computed
               (triton_prefill_attention)

Nothing here synchronizes with the host or depends on tensor values for its launch grids, so
decode steps can be captured in CUDA graphs (`graph_safe`). The same code runs on the CPU in
Triton's interpreter (TRITON_INTERPRET=1), which is how the suite tests it without a GPU.
"""

from __future__ import annotations

import torch

from densa.kernels.triton_common import is_available
from densa.model.attention import AttentionGroup, AttentionMetadata, LayerKVCache


class TritonAttentionBackend:
    name = "triton"
    # Launch grids depend only on shapes and no call reads a value back: capturable.
    graph_safe = True

    def __init__(self) -> None:
        if not is_available():
            raise RuntimeError("the 'triton' attention backend needs Triton: pip install triton")

    def store_kv(
        self, cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        from densa.kernels.triton_kv_store import store_kv

        store_kv(cache.k, cache.k_scale, meta.slot_pages, meta.slot_offsets, k)
        store_kv(cache.v, cache.v_scale, meta.slot_pages, meta.slot_offsets, v)

    def attend(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        group: AttentionGroup,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if group.max_query_len == 1:
            from densa.kernels.triton_decode_attention import paged_decode_attention

            return paged_decode_attention(
                q, cache.k, cache.v, group.page_table, group.seq_lens, scale,
                cache.k_scale, cache.v_scale,
            )  # fmt: skip
        from densa.kernels.triton_prefill_attention import paged_prefill_attention

        return paged_prefill_attention(
            q, cache.k, cache.v, group.page_table, group.seq_lens, group.query_lens, scale,
            cache.k_scale, cache.v_scale, new_kv, max_query_len=group.max_query_len,
        )  # fmt: skip
