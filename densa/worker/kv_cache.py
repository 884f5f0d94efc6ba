"""KV page tensors: how many pages a memory budget buys, and allocating them."""

from __future__ import annotations

import torch

from densa.model.arch import ArchConfig
from densa.model.attention import LayerKVCache

KV_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def page_bytes(arch: ArchConfig, page_size: int, kv_dtype: str) -> int:
    """Bytes of one page across all layers (K and V)."""
    element = torch.tensor([], dtype=KV_DTYPES[kv_dtype]).element_size()
    return int(arch.kv_bytes_per_token(element) * page_size)


def num_pages_for_budget(arch: ArchConfig, page_size: int, kv_dtype: str, budget_bytes: int) -> int:
    return budget_bytes // page_bytes(arch, page_size, kv_dtype)


def allocate_kv_caches(
    arch: ArchConfig, num_pages: int, page_size: int, kv_dtype: str, device: torch.device
) -> list[LayerKVCache]:
    """One zero-filled tensor for all layers (memory committed up front), viewed per layer."""
    shape = (arch.num_layers, 2, num_pages, arch.num_kv_heads, page_size, arch.head_dim)
    storage = torch.zeros(shape, dtype=KV_DTYPES[kv_dtype], device=device)
    return [LayerKVCache(k=storage[i, 0], v=storage[i, 1]) for i in range(arch.num_layers)]
