"""KV page tensors: what one cached token costs per KV dtype, how many pages a budget buys, and
allocating them (values, plus FP8 scales).

Bytes per token, all layers, K and V (L layers, H kv heads, D head dim):

    float32           2 * L * H * D * 4
    bfloat16/float16  2 * L * H * D * 2
    fp8_e4m3 static   2 * L * H * D * 1            (one float32 scale per layer: not per token)
    fp8_e4m3 dynamic  2 * L * H * (D * 1 + 1)      (one int8 exponent per token, head, K/V)
    int8              2 * L * H * (D * 1 + 2)      (one fp16 scale per token, head, K/V)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from densa.config import DEFAULT_KV_SCALES
from densa.memory import huge_page_zeros
from densa.model.arch import ArchConfig
from densa.model.attention import LayerKVCache
from densa.quant import fp8_kv, int8_kv

KV_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "int8": int8_kv.CODE_DTYPE,
}


def bytes_per_token(arch: ArchConfig, kv_dtype: str, kv_scales: str = DEFAULT_KV_SCALES) -> int:
    """Bytes one cached token takes across all layers: K and V values, plus FP8 scales."""
    values = int(arch.kv_bytes_per_token(KV_DTYPES[kv_dtype].itemsize))
    if kv_dtype == int8_kv.KV_DTYPE:
        return values + int8_kv.scale_bytes_per_token(arch.num_layers, arch.num_kv_heads)
    if kv_dtype != fp8_kv.KV_DTYPE:
        return values
    return values + fp8_kv.scale_bytes_per_token(arch.num_layers, arch.num_kv_heads, kv_scales)


def page_bytes(
    arch: ArchConfig, page_size: int, kv_dtype: str, kv_scales: str = DEFAULT_KV_SCALES
) -> int:
    """Bytes of one page across all layers (K and V, scales included)."""
    return bytes_per_token(arch, kv_dtype, kv_scales) * page_size


def num_pages_for_budget(
    arch: ArchConfig,
    page_size: int,
    kv_dtype: str,
    budget_bytes: int,
    kv_scales: str = DEFAULT_KV_SCALES,
) -> int:
    return budget_bytes // page_bytes(arch, page_size, kv_dtype, kv_scales)


@dataclass(frozen=True)
class KVCapacity:
    """What one KV format buys in a fixed budget (`densa capacity` prints these)."""

    kv_dtype: str
    kv_scales: str | None  # None for formats without scales
    bytes_per_token: int
    scale_bytes_per_token: int
    num_pages: int
    page_size: int

    @property
    def resident_tokens(self) -> int:
        return self.num_pages * self.page_size

    def max_requests(self, context_len: int) -> int:
        """Requests of `context_len` tokens (prompt + output) that fit at once: each needs
        whole pages."""
        return self.num_pages // -(-context_len // self.page_size)


def kv_capacity(
    arch: ArchConfig, budget_bytes: int, page_size: int, kv_dtype: str, kv_scales: str | None
) -> KVCapacity:
    scales = kv_scales or DEFAULT_KV_SCALES
    per_token = bytes_per_token(arch, kv_dtype, scales)
    values_only = int(arch.kv_bytes_per_token(KV_DTYPES[kv_dtype].itemsize))
    return KVCapacity(
        kv_dtype=kv_dtype,
        kv_scales=kv_scales if kv_dtype == fp8_kv.KV_DTYPE else None,
        bytes_per_token=per_token,
        scale_bytes_per_token=per_token - values_only,
        num_pages=budget_bytes // (per_token * page_size),
        page_size=page_size,
    )


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zero-filled and committed up front; on the CPU on huge pages, as the kernels stream it."""
    if device.type == "cpu":
        return huge_page_zeros(shape, dtype).zero_()  # writing commits the memory now
    return torch.zeros(shape, dtype=dtype, device=device)


def allocate_kv_caches(
    arch: ArchConfig,
    num_pages: int,
    page_size: int,
    kv_dtype: str,
    device: torch.device,
    kv_scales: str = DEFAULT_KV_SCALES,
    static_scales: fp8_kv.KVScales | None = None,
) -> list[LayerKVCache]:
    """One zero-filled tensor for all layers (memory committed up front), viewed per layer.

    FP8 caches also get their scales: with dynamic scales a second zero-filled int8 tensor of
    exponents, one per (page, head, slot) like the values; with static scales one 0-dim float32
    tensor per layer for K and for V, from `static_scales` (1.0 when None). INT8 caches get one
    fp16 scale per (page, head, slot).
    """
    shape = (arch.num_layers, 2, num_pages, arch.num_kv_heads, page_size, arch.head_dim)
    storage = _zeros(shape, KV_DTYPES[kv_dtype], device)
    caches = [LayerKVCache(k=storage[i, 0], v=storage[i, 1]) for i in range(arch.num_layers)]
    if kv_dtype == int8_kv.KV_DTYPE:  # one fp16 scale per (page, head, slot), like the values
        row_scales = _zeros(shape[:-1], int8_kv.SCALE_DTYPE, device)
        for i, cache in enumerate(caches):
            cache.k_scale, cache.v_scale = row_scales[i, 0], row_scales[i, 1]
        return caches
    if kv_dtype != fp8_kv.KV_DTYPE:
        return caches
    if kv_scales == "dynamic":
        exponents = torch.zeros(shape[:-1], dtype=fp8_kv.EXPONENT_SCALE_DTYPE, device=device)
        for i, cache in enumerate(caches):
            cache.k_scale, cache.v_scale = exponents[i, 0], exponents[i, 1]
        return caches
    scales = static_scales or fp8_kv.KVScales.ones(arch.num_layers)
    if scales.num_layers != arch.num_layers:
        raise ValueError(f"{scales.num_layers} layers of KV scales for {arch.num_layers} layers")
    for i, cache in enumerate(caches):
        cache.k_scale = torch.tensor(scales.k[i], dtype=torch.float32, device=device)
        cache.v_scale = torch.tensor(scales.v[i], dtype=torch.float32, device=device)
    return caches
