"""Whole K/V pages out of a cache and into another, in the caches' own KV formats.

The one place pages are copied between workers: `pack` gathers a transfer's source pages as raw
bytes of the source's format (densa/disagg/wire.py frames them), and `land` writes them into the
destination's pages (the runner does, when a step carries a KVLanding). Both ask the KVFormat the
caches carry what the pages hold; nothing is inferred from a tensor's dtype or shape.

    format                    packed values         packed row scales       static scales
    float32/bfloat16/float16  the values            -                       -
    fp8_e4m3, dynamic         e4m3 bytes            int8 exponents          -
    fp8_e4m3, static          e4m3 bytes            -                       [layer][part] floats
    int8                      int8 codes            fp16 scales             -

Sparse attention's index keys (DSA) travel with the pages they belong to, as a second pack in
their own format (PackedPages.index); pages with index keys land only where the model caches
them, and pages without them never land in a cache that needs them.

Landing, one layer and part at a time (so the float32 transient is one layer's pages):
    same format (static FP8: equal scales)  -> the bytes are copied, scales with them
    otherwise -> the source format decodes real values, the destination format stores them as
                 a prefill would (fresh row scales, or its own static scales)
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from densa.formats.kv_format import KVFormat
from densa.kernels.cpu.kv_store import store_kv
from densa.model.kv_layout import CachePart, LatentKVCache, LayerCache, cache_parts
from densa.sched.output import PackedPages


class LandingError(ValueError):
    """Packed pages that cannot land in this cache (another model's shape, an unknown format)."""


def cache_format(caches: Sequence[LayerCache]) -> KVFormat:
    return caches[0].kv_format


@dataclass(frozen=True)
class _PageParts:
    """Page tensors packed and landed together, in one format: per layer, its parts."""

    layers: list[list[CachePart]]
    kv_format: KVFormat

    @property
    def device(self) -> torch.device:
        return self.layers[0][0][0].device


def _kv_parts(caches: Sequence[LayerCache]) -> _PageParts:
    """K and V, or MLA's latent, of every layer."""
    return _PageParts([cache_parts(cache) for cache in caches], cache_format(caches))


def _index_parts(caches: Sequence[LayerCache]) -> _PageParts | None:
    """Sparse attention's index keys, of the layers that cache them (None: no such layer)."""
    indexes = [c.index for c in caches if isinstance(c, LatentKVCache) and c.index is not None]
    if not indexes:
        return None
    return _PageParts([[(index.keys, index.scale)] for index in indexes], indexes[0].kv_format)


def pack(caches: Sequence[LayerCache], page_ids: list[int]) -> PackedPages:
    """Copy whole pages out of `caches` (every layer and part, and sparse attention's index
    keys in the same pages), in their own formats."""
    index = torch.tensor(page_ids, dtype=torch.long, device=_device(caches))
    keys = _index_parts(caches)
    packed = _pack(_kv_parts(caches), index)
    return dataclasses.replace(packed, index=None if keys is None else _pack(keys, index))


def _pack(parts: _PageParts, index: torch.Tensor) -> PackedPages:
    kv_format = parts.kv_format
    # [num_layers, num_parts, n, H, P, D]
    values = torch.stack([torch.stack([v[index] for v, _ in layer]) for layer in parts.layers])
    row_scales = None
    if kv_format.row_scale_dtype is not None:
        # [num_layers, num_parts, n, H, P]
        scales = torch.stack(
            [torch.stack([_scale(s)[index] for _, s in layer]) for layer in parts.layers]
        )
        row_scales = _bytes_of(scales.cpu())
    static: list[list[float]] = []
    if kv_format.has_layer_scales:
        static = [[_static(s) for _, s in layer] for layer in parts.layers]
    return PackedPages(
        *kv_format.wire_form, tuple(values.shape), _bytes_of(values.cpu()),
        row_scales, static,
    )  # fmt: skip


def land(caches: Sequence[LayerCache], page_ids: list[int], pages: PackedPages) -> None:
    """Write packed pages into `page_ids`, converting the format where it differs. The caller
    has checked that the writer owns every destination page (tags). Raises LandingError,
    before writing anything, if the pages do not fit this cache."""
    keys = _index_parts(caches)
    if (keys is None) != (pages.index is None):
        has = "without" if pages.index is None else "with"
        raise LandingError(f"pages {has} sparse attention's index keys cannot land here")
    landings = [(_kv_parts(caches), pages)]
    if keys is not None and pages.index is not None:
        landings.append((keys, pages.index))
    checked = [
        (parts, packed, *_tensors(packed, parts, len(page_ids))) for parts, packed in landings
    ]  # fmt: skip  (all checked before any write)
    for parts, packed, values, row_scales in checked:
        _land(parts, page_ids, packed, values, row_scales)


def _land(
    parts: _PageParts,
    page_ids: list[int],
    pages: PackedPages,
    values: torch.Tensor,
    row_scales: torch.Tensor | None,
) -> None:
    source, dest, device = _format_of(pages), parts.kv_format, parts.device
    index = torch.tensor(page_ids, dtype=torch.long, device=device)
    copy_bytes = _same_format(source, dest, pages, parts)
    for layer, layer_parts in enumerate(parts.layers):
        for part, (dest_values, dest_scale) in enumerate(layer_parts):
            src = values[layer, part].to(device)  # [n, H, P, D]
            src_scale = None if row_scales is None else row_scales[layer, part].to(device)
            if copy_bytes:
                dest_values[index] = src
                if src_scale is not None:
                    _scale(dest_scale)[index] = src_scale
                continue
            if source.has_layer_scales:
                src_scale = torch.tensor(pages.static_scales[layer][part], device=device)
            real = source.dequantize(src, src_scale)
            store_pages(dest, dest_values, dest_scale, index, real)


def store_pages(
    kv_format: KVFormat,
    cache: torch.Tensor,
    scale: torch.Tensor | None,
    index: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Write real-valued pages [n, H, P, D] into `cache` at page ids `index`, quantized as
    `kv_format` stores a prefill's rows."""
    num_pages, num_heads, page_size, head_dim = values.shape
    slot_pages = index.repeat_interleave(page_size)
    slot_offsets = torch.arange(page_size, device=index.device).repeat(num_pages)
    # [n, H, P, D] -> [n * P, H, D]: one row per stored token, as the store path takes them
    rows = values.transpose(1, 2).reshape(num_pages * page_size, num_heads, head_dim)
    store_kv(kv_format, cache, scale, slot_pages, slot_offsets, rows.contiguous())


def _format_of(pages: PackedPages) -> KVFormat:
    try:
        return KVFormat.from_wire(pages.kv_dtype, pages.kv_scales)
    except ValueError as exc:
        raise LandingError(f"pages of an unknown KV format: {exc}") from exc


def _tensors(
    pages: PackedPages, parts: _PageParts, num_pages: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The packed buffers as tensors (views, no copy), checked against the destination."""
    source = _format_of(pages)
    first = parts.layers[0]
    want = (len(parts.layers), len(first), num_pages, *first[0][0].shape[1:])
    if tuple(pages.shape) != want:
        raise LandingError(f"pages shaped {list(pages.shape)} cannot land in {list(want)}")
    scale_dtype = source.row_scale_dtype
    if (pages.row_scales is None) != (scale_dtype is None):
        raise LandingError(
            f"{source.describe()} pages with row scales {pages.row_scales is not None}"
        )
    if source.has_layer_scales and [len(s) for s in pages.static_scales] != [want[1]] * want[0]:
        raise LandingError("static FP8 pages without one scale per layer and part")
    values = _tensor(pages.values, source.storage_dtype, list(want))
    if pages.row_scales is None or scale_dtype is None:
        return values, None
    return values, _tensor(pages.row_scales, scale_dtype, list(want[:-1]))


def _same_format(source: KVFormat, dest: KVFormat, pages: PackedPages, parts: _PageParts) -> bool:
    if source.wire_form != dest.wire_form:
        return False
    if not source.has_layer_scales:
        return True
    ours = [[_static(s) for _, s in layer] for layer in parts.layers]
    return ours == pages.static_scales


def _device(caches: Sequence[LayerCache]) -> torch.device:
    return cache_parts(caches[0])[0][0].device


def _scale(scale: torch.Tensor | None) -> torch.Tensor:
    assert scale is not None, "a format with per-row scales but a cache without them"
    return scale


def _static(scale: torch.Tensor | None) -> float:
    return 1.0 if scale is None else float(scale)  # no scale file: static FP8 stores with 1.0


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    array: Any = flat.numpy()
    return memoryview(array).cast("B")


def _tensor(buffer: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    expected = dtype.itemsize
    for size in shape:
        expected *= size
    if buffer.nbytes != expected:
        raise LandingError(f"a buffer of {buffer.nbytes} bytes, expected {expected}")
    if expected == 0:  # no pages: frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # a read-only buffer: landing only reads it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(buffer, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)
