"""What a model family caches per token and layer: its KV layout.

Every layout stores, per layer, `num_parts` page tensors shaped like a dense K or V cache,
[num_pages, num_heads, page_size, head_dim], so allocation, FP8 scales, page copies and the
integrity tags (which are per page and know nothing of what a page holds) are one code path:

    layout   parts          heads          head_dim                  per token and layer
    dense    K, V           num_kv_heads   head_dim                  2 * KVH * D values
    latent   c_kv | k_rope  1              kv_lora_rank + rope_dim   r + rope values  (MLA)

The latent layout is MLA's compressed cache: all heads' keys and values are decompressed from
one latent row, so a page holds one "head" and no separate V (the latent serves as both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig
from densa.model.attention import LayerKVCache

CachePart = tuple[torch.Tensor, torch.Tensor | None]  # (page values, their FP8 scales or None)


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_parts: int  # page tensors per layer: 2 (K, V) or 1 (MLA latent)
    num_heads: int
    head_dim: int

    @property
    def rows_per_token(self) -> int:
        """[head_dim] rows one token adds across all layers (each row gets one dynamic scale)."""
        return self.num_layers * self.num_parts * self.num_heads

    @property
    def values_per_token(self) -> int:
        return self.rows_per_token * self.head_dim


@dataclass
class LatentKVCache:
    """One MLA layer's pages. latent: [num_pages, 1, page_size, kv_lora_rank + rope_dim], each
    token's row = (normalized c_kv, RoPE-rotated shared key). FP8 scales as for K/V pages
    (densa.formats.fp8_kv): a 0-dim static scale, or int8 exponents [num_pages, 1, page_size]."""

    latent: torch.Tensor
    scale: torch.Tensor | None = None
    kv_format: KVFormat = None  # type: ignore[assignment]  # None: read off the tensors

    def __post_init__(self) -> None:
        if self.kv_format is None:
            self.kv_format = KVFormat.of_tensors(self.latent, self.scale)

    @property
    def page_size(self) -> int:
        return self.latent.shape[2]

    def parts(self) -> list[CachePart]:
        return [(self.latent, self.scale)]


LayerCache = LayerKVCache | LatentKVCache


class KVLayout(Protocol):
    """A family's cache layout: its geometry, and the per-layer cache object over its parts."""

    name: str

    def geometry(self, arch: ArchConfig) -> KVGeometry: ...

    def layer_cache(self, parts: list[CachePart], kv_format: KVFormat) -> LayerCache:
        """Wrap one layer's `num_parts` (values, scale) pairs stored in `kv_format`."""
        ...


class DenseKVLayout:
    name = "dense"

    def geometry(self, arch: ArchConfig) -> KVGeometry:
        return KVGeometry(arch.num_layers, 2, arch.num_kv_heads, arch.head_dim)

    def layer_cache(self, parts: list[CachePart], kv_format: KVFormat) -> LayerKVCache:
        (k, k_scale), (v, v_scale) = parts
        return LayerKVCache(k=k, v=v, k_scale=k_scale, v_scale=v_scale, kv_format=kv_format)


class LatentKVLayout:
    name = "latent"

    def geometry(self, arch: ArchConfig) -> KVGeometry:
        if arch.mla is None:
            raise ValueError(f"{arch.architecture} has no latent-attention settings")
        return KVGeometry(arch.num_layers, 1, 1, arch.mla.latent_dim)

    def layer_cache(self, parts: list[CachePart], kv_format: KVFormat) -> LatentKVCache:
        ((latent, scale),) = parts
        return LatentKVCache(latent=latent, scale=scale, kv_format=kv_format)


def cache_parts(cache: LayerCache) -> list[CachePart]:
    """The (values, scale) page tensors of one layer's cache, whatever its layout."""
    if isinstance(cache, LatentKVCache):
        return cache.parts()
    return [(cache.k, cache.k_scale), (cache.v, cache.v_scale)]


def scratch_caches(
    layout: KVLayout, arch: ArchConfig, num_pages: int, page_size: int, dtype: torch.dtype
) -> list[LayerCache]:
    """Zero-filled unquantized caches for one offline pass (calibration), no engine needed."""
    geo = layout.geometry(arch)
    shape = (num_pages, geo.num_heads, page_size, geo.head_dim)
    kv_format = KVFormat.of_tensors(torch.empty(0, dtype=dtype), None)
    return [
        layout.layer_cache(
            [(torch.zeros(shape, dtype=dtype), None) for _ in range(geo.num_parts)], kv_format
        )
        for _ in range(geo.num_layers)
    ]
