"""KV page tensors: what one cached token costs per KV dtype, how many pages a budget buys, and
allocating them (values, plus FP8 and INT8 scales). Every function takes the one KVFormat
(densa.formats.kv_format) the engine built from its config, never a dtype name.

The model family's KV layout (densa.model.kv_layout) says what a token caches per layer: P page
tensors ("parts") of H heads x D values -- K and V per KV head (P = 2), or MLA's one latent row
(P = 1, H = 1, D = kv_lora_rank + rope dim). Bytes per token, all L layers:

    float32           P * L * H * D * 4
    bfloat16/float16  P * L * H * D * 2
    fp8_e4m3 static   P * L * H * D * 1            (one float32 scale per layer and part)
    fp8_e4m3 dynamic  P * L * H * (D * 1 + 1)      (one int8 exponent per token, head and part)
    int8              P * L * H * (D * 1 + 2)      (one fp16 scale per token, head and part)

Sparse attention (DSA) adds, in each of its L_I full indexer layers, one index key of D_I values
per token in the same pages, in KVFormat.index_keys() (the pages' dtype unless the format names
another): float32/bf16/fp16 as they are, FP8 and INT8 with one scale per 128-value block:

    + L_I * D_I * itemsize  (+ L_I * D_I / 128 * scale bytes: 1 for FP8, 2 for INT8)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from densa.formats import fp8_kv
from densa.formats.kv_format import KVFormat
from densa.memory import huge_page_zeros
from densa.model.arch import ArchConfig
from densa.model.kv_layout import (
    IndexKeyCache,
    KVGeometry,
    LatentKVCache,
    LayerCache,
)
from densa.model.registry import kv_layout


def kv_geometry(arch: ArchConfig) -> KVGeometry:
    return kv_layout(arch.architecture).geometry(arch)


def value_bytes_per_token(arch: ArchConfig, kv_format: KVFormat) -> int:
    """Bytes of one cached token's values across all layers (K and V, or the latent, and the
    index keys of sparse attention, in `kv_format.index_keys()`)."""
    return kv_geometry(arch).value_bytes_per_token(kv_format)


def scale_bytes_per_token(arch: ArchConfig, kv_format: KVFormat) -> int:
    """Bytes the scales add to one cached token: one per [head_dim] row of the values (FP8
    dynamic, INT8), and the index keys' block scales (0 without sparse attention)."""
    return kv_geometry(arch).scale_bytes_per_token(kv_format)


def bytes_per_token(arch: ArchConfig, kv_format: KVFormat) -> int:
    """Bytes one cached token takes across all layers: its values and their scales."""
    return value_bytes_per_token(arch, kv_format) + scale_bytes_per_token(arch, kv_format)


def page_bytes(arch: ArchConfig, page_size: int, kv_format: KVFormat) -> int:
    """Bytes of one page across all layers (K and V, scales and index keys included)."""
    return kv_geometry(arch).page_bytes(page_size, kv_format)


def num_pages_for_budget(
    arch: ArchConfig, page_size: int, kv_format: KVFormat, budget_bytes: int
) -> int:
    return budget_bytes // page_bytes(arch, page_size, kv_format)


@dataclass(frozen=True)
class KVCapacity:
    """What one KV format buys in a fixed budget (`densa capacity` prints these)."""

    kv_dtype: str
    kv_scales: str | None  # FP8: dynamic | static; INT8: row (one fp16 per row); None: no scales
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
    arch: ArchConfig, budget_bytes: int, page_size: int, kv_format: KVFormat
) -> KVCapacity:
    per_token = bytes_per_token(arch, kv_format)
    return KVCapacity(
        kv_dtype=kv_format.name,
        kv_scales=kv_format.scales if kv_format.is_quantized else None,
        bytes_per_token=per_token,
        scale_bytes_per_token=scale_bytes_per_token(arch, kv_format),
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
    kv_format: KVFormat,
    device: torch.device,
    static_scales: fp8_kv.KVScales | None = None,
) -> list[LayerCache]:
    """One zero-filled tensor for all layers (memory committed up front), viewed per layer and
    part, and wrapped in the family's per-layer cache objects, which carry `kv_format`.

    Formats with row scales also get them: FP8 dynamic a zero-filled int8 exponent, INT8 an
    fp16 scale, per (page, head, slot) and part like the values; static FP8 one 0-dim float32
    tensor per layer and part (K, V), from `static_scales` (1.0 when None). Sparse attention's
    index keys go in the same pages, in `kv_format.index_keys()`.
    """
    layout = kv_layout(arch.architecture)
    geo = layout.geometry(arch)
    shape = (geo.num_layers, geo.num_parts, num_pages, geo.num_heads, page_size, geo.head_dim)
    storage = _zeros(shape, kv_format.storage_dtype, device)
    scales = _scales(geo, shape, kv_format, static_scales, device)
    source = static_scales.source if static_scales and kv_format.has_layer_scales else None
    kv_format = dataclasses.replace(kv_format, static_source=source)
    caches = [
        layout.layer_cache(
            [(storage[layer, part], scales[layer][part]) for part in range(geo.num_parts)],
            kv_format,
        )
        for layer in range(geo.num_layers)
    ]
    if geo.index is not None:
        assert arch.dsa is not None
        index_caches = _index_caches(geo.index, num_pages, page_size, kv_format.index_keys(),
                                     device)  # fmt: skip
        for layer, index in zip(arch.dsa.full_layer_ids(), index_caches, strict=True):
            cache = caches[layer]
            assert isinstance(cache, LatentKVCache)
            cache.index = index
    return caches


def _index_caches(
    geo: KVGeometry, num_pages: int, page_size: int, fmt: KVFormat, device: torch.device
) -> list[IndexKeyCache]:
    """The index keys of every full indexer layer in `fmt`: one zero-filled tensor, like the
    latents, [layers, num_pages, blocks, page_size, block], and its per-block scales."""
    shape = (geo.num_layers, num_pages, geo.num_heads, page_size, geo.head_dim)
    keys = _zeros(shape, fmt.storage_dtype, device)
    scale_dtype = fmt.row_scale_dtype
    scales = None if scale_dtype is None else _zeros(shape[:-1], scale_dtype, device)
    return [
        IndexKeyCache(keys[layer], None if scales is None else scales[layer], fmt)
        for layer in range(geo.num_layers)
    ]


def _scales(
    geo: KVGeometry,
    shape: tuple[int, ...],
    kv_format: KVFormat,
    static_scales: fp8_kv.KVScales | None,
    device: torch.device,
) -> list[list[torch.Tensor | None]]:
    """Per layer and part: the FP8 or INT8 scale tensor, or None for unquantized caches."""
    row_dtype = kv_format.row_scale_dtype
    if row_dtype is not None:  # one per (page, head, slot), like the values
        row_scales = _zeros(shape[:-1], row_dtype, device)
        return [list(row_scales[layer]) for layer in range(geo.num_layers)]
    if not kv_format.has_layer_scales:
        return [[None] * geo.num_parts for _ in range(geo.num_layers)]
    scales = static_scales or fp8_kv.KVScales.ones(geo.num_layers)
    if scales.num_layers != geo.num_layers:
        raise ValueError(f"{scales.num_layers} layers of KV scales for {geo.num_layers} layers")
    per_part = (scales.k, scales.v)[: geo.num_parts]  # a latent cache has one part (K's scale)
    return [
        [torch.tensor(values[layer], dtype=torch.float32, device=device) for values in per_part]
        for layer in range(geo.num_layers)
    ]
