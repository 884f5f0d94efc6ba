"""The attention backends by name, each declaring what it can do; the engine asks the
declaration (`capabilities`), never the name.

    name     runs on          CUDA graphs  fused C++ decode  batched tag check  KV encodings
    torch    cpu, cuda        no           no                no                 all
    cpu      cpu              no           yes               no                 all
    triton   cuda (cpu: in    yes          no                yes                none, static,
             Triton's interpreter, TRITON_INTERPRET=1, which is how the suite tests it)    dynamic

The Triton backend runs densa's Triton kernels (densa/kernels/triton/) for every group of a step:

    store_kv   one Triton launch per K and per V: cast, or quantize to FP8 with scales, and
               scatter into the page slots (kernels/triton/kv_store.py)
    decode     split-K paged decode attention over the pages in place (decode_attention.py)
    prefill    paged varlen causal attention, earlier context from the pages, the chunk itself
               from the pages or, for FP8 pages, from its own K/V as computed (prefill_attention.py)
    MLA        sparse (DSA) decode: absorbed attention over each sequence's top-k latent rows,
               gathered from the pages in place (sparse_latent_decode.py); MLA's dense decode,
               its prefill and its latent store take densa.model.latent_attention's torch paths

Nothing there synchronizes with the host or depends on tensor values for its launch grids, so
its decode steps can be captured in CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from densa.formats.kv_format import DYNAMIC, NO_SCALES, STATIC
from densa.model.attention import (
    AttentionBackend,
    AttentionGroup,
    AttentionMetadata,
    BackendCapabilities,
    CpuAttentionBackend,
    LayerKVCache,
    TorchAttentionBackend,
)


class TritonAttentionBackend:
    name = "triton"
    capabilities = BackendCapabilities(
        supports_cuda_graphs=True,
        fused_decode=False,
        batched_tag_check=True,
        kv_encodings=frozenset({NO_SCALES, STATIC, DYNAMIC}),
    )

    def __init__(self) -> None:
        from densa.kernels.triton.common import is_available  # imports Triton: only when asked

        if not is_available():
            raise RuntimeError("the 'triton' attention backend needs Triton: pip install triton")

    def store_kv(
        self, cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        from densa.kernels.triton.kv_store import store_kv

        fmt = cache.kv_format
        store_kv(cache.k, cache.k_scale, meta.slot_pages, meta.slot_offsets, k, fmt)
        store_kv(cache.v, cache.v_scale, meta.slot_pages, meta.slot_offsets, v, fmt)

    def attend(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        group: AttentionGroup,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if group.max_query_len == 1:
            from densa.kernels.triton.decode_attention import paged_decode_attention

            return paged_decode_attention(
                q, cache.k, cache.v, group.page_table, group.seq_lens, scale,
                cache.k_scale, cache.v_scale, kv_format=cache.kv_format,
            )  # fmt: skip
        from densa.kernels.triton.prefill_attention import paged_prefill_attention

        return paged_prefill_attention(
            q, cache.k, cache.v, group.page_table, group.seq_lens, group.query_lens, scale,
            cache.k_scale, cache.v_scale, new_kv, max_query_len=group.max_query_len,
            kv_format=cache.kv_format,
        )  # fmt: skip


def _cpu_backend(device: torch.device) -> AttentionBackend:
    if device.type != "cpu":
        raise ValueError("the 'cpu' attention backend runs on the CPU only; use 'triton'")
    return CpuAttentionBackend()


# name -> a factory for the device the engine runs on
ATTENTION_BACKENDS: dict[str, Callable[[torch.device], AttentionBackend]] = {
    "torch": lambda device: TorchAttentionBackend(),
    "cpu": _cpu_backend,
    "triton": lambda device: TritonAttentionBackend(),  # imports Triton
}


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """auto: the Triton kernels on a GPU (torch's if Triton is missing), Numba's on the CPU.
    'triton' also runs on the CPU, in Triton's interpreter (TRITON_INTERPRET=1): tests use it."""
    if name == "auto":
        name = "cpu" if device.type == "cpu" else "triton" if _has_triton() else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}")
    return ATTENTION_BACKENDS[name](device)


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None
