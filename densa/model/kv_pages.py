"""KV page tensors: what one cached token costs per KV dtype, how many pages a budget buys, and
allocating them (values, plus FP8 scales).

The model family's KV layout (densa.model.kv_layout) says what a token caches per layer: P page
tensors ("parts") of H heads x D values -- K and V per KV head (P = 2), or MLA's one latent row
(P = 1, H = 1, D = kv_lora_rank + rope dim). Bytes per token, all L layers:

    float32           P * L * H * D * 4
    bfloat16/float16  P * L * H * D * 2
    fp8_e4m3 static   P * L * H * D * 1            (one float32 scale per layer and part)
    fp8_e4m3 dynamic  P * L * H * (D * 1 + 1)      (one int8 exponent per token, head and part)
    int8              P * L * H * (D * 1 + 2)      (one fp16 scale per token, head and part)

Sparse attention (DSA) adds, in each of its L_I full indexer layers, one index key of D_I values
per token in the same pages, in the pages' dtype: float32/bf16/fp16 as they are, FP8 and INT8
with one scale per 128-value block (densa.model.kv_layout.index_format):

    + L_I * D_I * itemsize  (+ L_I * D_I / 128 * scale bytes: 1 for FP8, 2 for INT8)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from densa.config import DEFAULT_KV_SCALES
from densa.formats import fp8_kv, int8_kv
from densa.formats.kv_format import KVFormat
from densa.memory import huge_page_zeros
from densa.model.arch import ArchConfig
from densa.model.kv_layout import (
    IndexKeyCache,
    KVGeometry,
    LatentKVCache,
    LayerCache,
    index_format,
)
from densa.model.registry import kv_layout

KV_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "int8": int8_kv.CODE_DTYPE,
}


def kv_geometry(arch: ArchConfig) -> KVGeometry:
    return kv_layout(arch.architecture).geometry(arch)


def value_bytes_per_token(
    arch: ArchConfig, kv_dtype: str, index_kv_dtype: str | None = None
) -> int:
    """Bytes of one cached token's values across all layers (K and V, or the latent, and the
    index keys of sparse attention: in `index_kv_dtype`, None = the pages' dtype)."""
    geo = kv_geometry(arch)
    values = geo.values_per_token * KV_DTYPES[kv_dtype].itemsize
    if geo.index is None:
        return values
    keys = index_format(KVFormat.of(kv_dtype, "dynamic"), index_kv_dtype)
    return values + geo.index.values_per_token * keys.value_bytes()


def index_scale_bytes_per_token(
    arch: ArchConfig, kv_dtype: str, index_kv_dtype: str | None = None
) -> int:
    """Bytes the index keys' block scales add to one cached token (0 without sparse attention
    or for unquantized keys)."""
    index = kv_geometry(arch).index
    if index is None:
        return 0
    keys = index_format(KVFormat.of(kv_dtype, "dynamic"), index_kv_dtype)
    return index.rows_per_token * keys.scale_bytes_per_row()


def scale_bytes_per_token(arch: ArchConfig, kv_scales: str) -> int:
    """Bytes the FP8 scales add to one cached token (one per [head_dim] row when dynamic)."""
    if kv_scales not in fp8_kv.SCALE_BYTES:
        raise ValueError(f"kv scale policy must be one of {fp8_kv.SCALE_POLICIES}")
    return kv_geometry(arch).rows_per_token * fp8_kv.SCALE_BYTES[kv_scales]


def bytes_per_token(
    arch: ArchConfig,
    kv_dtype: str,
    kv_scales: str = DEFAULT_KV_SCALES,
    index_kv_dtype: str | None = None,
) -> int:
    """Bytes one cached token takes across all layers: its values, plus FP8 scales (and sparse
    attention's index keys, in `index_kv_dtype`; None = the pages' dtype)."""
    values = value_bytes_per_token(arch, kv_dtype, index_kv_dtype)
    values += index_scale_bytes_per_token(arch, kv_dtype, index_kv_dtype)
    if kv_dtype == int8_kv.KV_DTYPE:
        return values + kv_geometry(arch).rows_per_token * int8_kv.SCALE_BYTES
    if kv_dtype != fp8_kv.KV_DTYPE:
        return values
    return values + scale_bytes_per_token(arch, kv_scales)


def page_bytes(
    arch: ArchConfig,
    page_size: int,
    kv_dtype: str,
    kv_scales: str = DEFAULT_KV_SCALES,
    index_kv_dtype: str | None = None,
) -> int:
    """Bytes of one page across all layers (K and V, scales included)."""
    return bytes_per_token(arch, kv_dtype, kv_scales, index_kv_dtype) * page_size


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
    arch: ArchConfig, budget_bytes: int, page_size: int, kv_dtype: str, kv_scales: str | None
) -> KVCapacity:
    scales = kv_scales or DEFAULT_KV_SCALES
    per_token = bytes_per_token(arch, kv_dtype, scales)
    values_only = value_bytes_per_token(arch, kv_dtype)
    return KVCapacity(
        kv_dtype=kv_dtype,
        kv_scales=_capacity_scales(kv_dtype, kv_scales),
        bytes_per_token=per_token,
        scale_bytes_per_token=per_token - values_only,
        num_pages=budget_bytes // (per_token * page_size),
        page_size=page_size,
    )


def _capacity_scales(kv_dtype: str, fp8_scales: str | None) -> str | None:
    if kv_dtype == fp8_kv.KV_DTYPE:
        return fp8_scales
    return "row" if kv_dtype == int8_kv.KV_DTYPE else None


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
    index_kv_dtype: str | None = None,
) -> list[LayerCache]:
    """One zero-filled tensor for all layers (memory committed up front), viewed per layer and
    part, and wrapped in the family's per-layer cache objects.

    FP8 caches also get their scales: with dynamic scales a second zero-filled int8 tensor of
    exponents, one per (page, head, slot) like the values; with static scales one 0-dim float32
    tensor per layer and part (K, V), from `static_scales` (1.0 when None). INT8 caches get one
    fp16 scale per (page, head, slot) and part.
    """
    layout = kv_layout(arch.architecture)
    geo = layout.geometry(arch)
    shape = (geo.num_layers, geo.num_parts, num_pages, geo.num_heads, page_size, geo.head_dim)
    storage = _zeros(shape, KV_DTYPES[kv_dtype], device)
    scales = _scales(geo, shape, kv_dtype, kv_scales, static_scales, device)
    kv_format = KVFormat.of(kv_dtype, kv_scales, static_scales.source if static_scales else None)
    caches = [
        layout.layer_cache(
            [(storage[layer, part], scales[layer][part]) for part in range(geo.num_parts)],
            kv_format,
        )
        for layer in range(geo.num_layers)
    ]
    if geo.index is not None:
        assert arch.dsa is not None
        keys = index_format(kv_format, index_kv_dtype)
        index_caches = _index_caches(geo.index, num_pages, page_size, keys, device)
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
    kv_dtype: str,
    kv_scales: str,
    static_scales: fp8_kv.KVScales | None,
    device: torch.device,
) -> list[list[torch.Tensor | None]]:
    """Per layer and part: the FP8 or INT8 scale tensor, or None for unquantized caches."""
    if kv_dtype == int8_kv.KV_DTYPE:  # one fp16 scale per (page, head, slot), like the values
        row_scales = _zeros(shape[:-1], int8_kv.SCALE_DTYPE, device)
        return [list(row_scales[layer]) for layer in range(geo.num_layers)]
    if kv_dtype != fp8_kv.KV_DTYPE:
        return [[None] * geo.num_parts for _ in range(geo.num_layers)]
    if kv_scales == "dynamic":
        exponents = torch.zeros(shape[:-1], dtype=fp8_kv.EXPONENT_SCALE_DTYPE, device=device)
        return [list(exponents[layer]) for layer in range(geo.num_layers)]
    scales = static_scales or fp8_kv.KVScales.ones(geo.num_layers)
    if scales.num_layers != geo.num_layers:
        raise ValueError(f"{scales.num_layers} layers of KV scales for {geo.num_layers} layers")
    per_part = (scales.k, scales.v)[: geo.num_parts]  # a latent cache has one part (K's scale)
    return [
        [torch.tensor(values[layer], dtype=torch.float32, device=device) for values in per_part]
        for layer in range(geo.num_layers)
    ]
