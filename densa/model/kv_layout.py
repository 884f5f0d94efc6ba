"""What a model family caches per token and layer: its KV layout.

Every layout stores, per layer, `num_parts` page tensors shaped like a dense K or V cache,
[num_pages, num_heads, page_size, head_dim], so allocation, FP8 scales, page copies and the
integrity tags (which are per page and know nothing of what a page holds) are one code path:

    layout   parts          heads          head_dim                  per token and layer
    dense    K, V           num_kv_heads   head_dim                  2 * KVH * D values
    latent   c_kv | k_rope  1              kv_lora_rank + rope_dim   r + rope values  (MLA)
    sparse   latent, and in the indexer's "full" layers one index key of index_head_dim values
             (DSA), its own page tensor [num_pages, blocks, page_size, block]

The latent layout is MLA's compressed cache: all heads' keys and values are decompressed from
one latent row, so a page holds one "head" and no separate V (the latent serves as both).

The sparse layout (DeepSeek-V3.2, GLM-5) adds the indexer's keys to the same pages: page p of
the index keys belongs to the same tokens as page p of the latents, so allocation, integrity
tags, prefix caching and release cover both at once. An index key is split into blocks of up to
INDEX_BLOCK values stored as "heads", so a quantized format's one scale per (page, head, slot)
is one scale per 128-value block, as DeepSeek-V3.2 stores its FP8 index keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig
from densa.model.attention import LayerKVCache
from densa.model.family_config import LinearAttentionConfig

CachePart = tuple[torch.Tensor, torch.Tensor | None]  # (page values, their FP8 scales or None)
INDEX_BLOCK = 128  # values of an index key under one scale (DeepSeek-V3.2's FP8 block)


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_parts: int  # page tensors per layer: 2 (K, V) or 1 (MLA latent)
    num_heads: int
    head_dim: int
    # The indexer's keys (sparse layout): their own geometry, layers = the full indexer layers.
    index: KVGeometry | None = None

    @property
    def rows_per_token(self) -> int:
        """[head_dim] rows one token adds across all layers (each row gets one dynamic scale)."""
        return self.num_layers * self.num_parts * self.num_heads

    @property
    def values_per_token(self) -> int:
        return self.rows_per_token * self.head_dim

    # The page arithmetic, once: densa.model.kv_pages sizes a model's pages with these, and the
    # P/D handshake sizes a peer's pages with them from the peer's signature (same formulas).
    def value_bytes_per_token(self, kv_format: KVFormat) -> int:
        """Bytes of one token's values across all layers, the index keys (in
        `kv_format.index_keys()`) included."""
        values = self.values_per_token * kv_format.value_bytes()
        if self.index is None:
            return values
        return values + self.index.values_per_token * kv_format.index_keys().value_bytes()

    def scale_bytes_per_token(self, kv_format: KVFormat) -> int:
        """Bytes the scales add to one token: one per [head_dim] row (FP8 dynamic, INT8), and
        the index keys' block scales."""
        scales = self.rows_per_token * kv_format.scale_bytes_per_row()
        if self.index is None:
            return scales
        return scales + self.index.rows_per_token * kv_format.index_keys().scale_bytes_per_row()

    def page_bytes(self, page_size: int, kv_format: KVFormat) -> int:
        """Bytes of one page across all layers: values and scales of `page_size` tokens."""
        per_token = self.value_bytes_per_token(kv_format) + self.scale_bytes_per_token(kv_format)
        return per_token * page_size


@dataclass
class IndexKeyCache:
    """One DSA layer's index keys. keys: [num_pages, blocks, page_size, block], a token's key of
    blocks * block values (its RoPE'd and, when quantized, Hadamard-rotated indexer key); scales
    as the format keeps them per (page, block, slot), or None."""

    keys: torch.Tensor
    scale: torch.Tensor | None
    kv_format: KVFormat

    @property
    def head_dim(self) -> int:
        return self.keys.shape[1] * self.keys.shape[3]


@dataclass
class LatentKVCache:
    """One MLA layer's pages. latent: [num_pages, 1, page_size, kv_lora_rank + rope_dim], each
    token's row = (normalized c_kv, RoPE-rotated shared key). FP8 scales as for K/V pages
    (densa.formats.fp8_kv): a 0-dim static scale, or int8 exponents [num_pages, 1, page_size].
    index: the layer's DSA index keys in the same page ids (None: dense MLA, or a layer that
    reuses another's top-k)."""

    latent: torch.Tensor
    scale: torch.Tensor | None = None
    kv_format: KVFormat = None  # type: ignore[assignment]  # None: read off the tensors
    index: IndexKeyCache | None = None

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


class SparseLatentKVLayout(LatentKVLayout):
    """MLA latents plus the DSA indexer's keys, one key per token in each full indexer layer."""

    name = "sparse"

    def geometry(self, arch: ArchConfig) -> KVGeometry:
        if arch.dsa is None:
            raise ValueError(
                f"{arch.architecture} needs its indexer's index_topk, index_head_dim and "
                "index_n_heads in config.json"
            )
        latent = super().geometry(arch)
        block = min(arch.dsa.head_dim, INDEX_BLOCK)
        if arch.dsa.head_dim % block:
            raise ValueError(f"index_head_dim {arch.dsa.head_dim} is not whole {block}-blocks")
        index = KVGeometry(arch.dsa.num_full_layers, 1, arch.dsa.head_dim // block, block)
        return dataclasses.replace(latent, index=index)


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


@dataclass(frozen=True)
class StateGeometry:
    """What one request keeps per linear-attention layer, whatever its length (hybrid models):
    a conv window of conv_values (compute dtype) and a recurrent state of recurrent_values
    (float32: the recurrence accumulates over the whole history)."""

    num_layers: int
    conv_values: int  # conv_dim * (conv_kernel - 1)
    recurrent_values: int  # Hv * Dk * Dv

    def slot_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one request's state slot across all linear layers."""
        return self.num_layers * (self.conv_values * dtype_bytes + self.recurrent_values * 4)


class HybridKVLayout(DenseKVLayout):
    """Gated DeltaNet + full attention (Qwen3-Next, Qwen3.5): K/V pages for the full-attention
    layers only, and a fixed-size state slot per request for the linear ones."""

    name = "hybrid"

    def geometry(self, arch: ArchConfig) -> KVGeometry:
        linear = _linear_settings(arch)
        num_full = arch.num_layers - linear.num_linear_layers
        return KVGeometry(num_full, 2, arch.num_kv_heads, arch.head_dim)

    def state_geometry(self, arch: ArchConfig) -> StateGeometry:
        linear = _linear_settings(arch)
        recurrent = linear.num_value_heads * linear.key_head_dim * linear.value_head_dim
        conv = linear.conv_dim * (linear.conv_kernel - 1)
        return StateGeometry(linear.num_linear_layers, conv, recurrent)


def _linear_settings(arch: ArchConfig) -> LinearAttentionConfig:
    if arch.linear is None:
        raise ValueError(f"{arch.architecture} has no linear-attention (Gated DeltaNet) settings")
    return arch.linear
