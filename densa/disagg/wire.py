"""K/V pages <-> wire frames: gathered from one worker's cache, landed in another's.

The source sends pages in its own storage format, never re-encoded (no float32 wire format):

    float32 / bfloat16 / float16   the values' bytes
    fp8_e4m3, dynamic scales       the e4m3 bytes + the int8 scale exponents (one per token, head)
    fp8_e4m3, static scales        the e4m3 bytes + the per-layer K and V scales (in the header)

Landing converts only where the formats differ, one layer at a time (so the float32 transient
is one layer's worth of these pages, not the whole transfer):

    same dtype (fp8: same scale policy, equal static scales)  -> bytes copied as they are
    anything else -> real values (fp8: e4m3 * scale) -> stored as a prefill would store them
                     (fp8 destinations get fresh per-token scales, or their own static scales)
"""

from __future__ import annotations

import warnings
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from densa.disagg.messages import WireLayout
from densa.kernels.fp8_store import store_fp8
from densa.kernels.paged_attention_ref import EXPONENT_SCALE_DTYPE, dequantize_pages
from densa.model.attention import LayerKVCache
from densa.quant import fp8_kv

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
}


class WireError(ValueError):
    """The frames do not match their layout (truncated, corrupted, or another format)."""


@dataclass(frozen=True)
class Packed:
    layout: WireLayout
    frames: list[memoryview]  # raw buffers: values, then (fp8 dynamic) exponents

    @property
    def num_bytes(self) -> int:
        return sum(frame.nbytes for frame in self.frames)


def kv_scales_of(caches: list[LayerKVCache]) -> str:
    first = caches[0]
    if first.k.dtype != fp8_kv.FP8_DTYPE:
        return "none"
    assert first.k_scale is not None
    return "static" if first.k_scale.dim() == 0 else "dynamic"


def dtype_name(caches: list[LayerKVCache]) -> str:
    return next(name for name, dtype in _DTYPES.items() if dtype == caches[0].k.dtype)


def pack_pages(caches: list[LayerKVCache], page_ids: list[int]) -> Packed:
    """Copy pages out of the cache, all layers, K and V, in its own format."""
    index = torch.tensor(page_ids, dtype=torch.long, device=caches[0].k.device)
    # [num_layers, 2, n, KVH, P, D]
    values = torch.stack([torch.stack([c.k[index], c.v[index]]) for c in caches]).cpu()
    frames = [_bytes_of(values)]
    scales = kv_scales_of(caches)
    static: list[list[float]] = []
    if scales == "dynamic":
        exponents = torch.stack(
            [torch.stack([_scale(c.k_scale)[index], _scale(c.v_scale)[index]]) for c in caches]
        ).cpu()  # [num_layers, 2, n, KVH, P]
        frames.append(_bytes_of(exponents))
    elif scales == "static":
        static = [[float(_scale(c.k_scale)), float(_scale(c.v_scale))] for c in caches]
    layout = WireLayout(
        kv_dtype=dtype_name(caches),
        kv_scales=scales,
        shape=list(values.shape),
        static_scales=static,
        checksums=[zlib.crc32(frame) for frame in frames],
    )
    return Packed(layout, frames)


def check_frames(layout: WireLayout, frames: list[memoryview], num_pages: int) -> None:
    """Raise WireError unless the frames are exactly what the layout announces, undamaged."""
    if layout.kv_dtype not in _DTYPES or len(layout.shape) != 6 or layout.shape[2] != num_pages:
        raise WireError(f"a layout of {layout.kv_dtype} {layout.shape} for {num_pages} pages")
    num_values = 1
    for size in layout.shape:
        num_values *= size
    sizes = [num_values * _DTYPES[layout.kv_dtype].itemsize]
    if layout.kv_scales == "dynamic":
        sizes.append(num_values // layout.shape[-1])
    if [f.nbytes for f in frames] != sizes:
        raise WireError(f"frames of {[f.nbytes for f in frames]} bytes, expected {sizes}")
    if [zlib.crc32(f) for f in frames] != list(layout.checksums):
        raise WireError("a frame's checksum does not match: damaged in flight")


def land_pages(
    caches: list[LayerKVCache], page_ids: list[int], layout: WireLayout, frames: list[memoryview]
) -> None:
    """Write checked frames into the destination pages, converting the format where it differs.
    The caller has checked ownership (tags) and the frames (check_frames)."""
    device = caches[0].k.device
    index = torch.tensor(page_ids, dtype=torch.long, device=device)
    values = _tensor(frames[0], _DTYPES[layout.kv_dtype], layout.shape)
    exponents = None
    if layout.kv_scales == "dynamic":
        exponents = _tensor(frames[1], EXPONENT_SCALE_DTYPE, layout.shape[:-1])
    byte_copy = _can_copy_bytes(caches, layout)
    for layer, cache in enumerate(caches):
        for kv, (dest, dest_scale) in enumerate(
            ((cache.k, cache.k_scale), (cache.v, cache.v_scale))
        ):
            src = values[layer, kv].to(device)  # [n, KVH, P, D]
            if byte_copy:
                dest[index] = src
                if exponents is not None:
                    _scale(dest_scale)[index] = exponents[layer, kv].to(device)
                continue
            real = _real_values(src, layout, exponents, layer, kv)
            _store(dest, dest_scale, index, real)


def _can_copy_bytes(caches: list[LayerKVCache], layout: WireLayout) -> bool:
    if layout.kv_dtype != dtype_name(caches) or layout.kv_scales != kv_scales_of(caches):
        return False
    if layout.kv_scales != "static":
        return True
    ours = [[float(_scale(c.k_scale)), float(_scale(c.v_scale))] for c in caches]
    return ours == layout.static_scales


def _real_values(
    src: torch.Tensor, layout: WireLayout, exponents: torch.Tensor | None, layer: int, kv: int
) -> torch.Tensor:
    if layout.kv_dtype != "fp8_e4m3":
        return src.float()
    all_pages = torch.arange(src.shape[0], device=src.device)
    if exponents is not None:
        scale = exponents[layer, kv].to(src.device)
    else:
        scale = torch.tensor(layout.static_scales[layer][kv], dtype=torch.float32)
    return dequantize_pages(src, all_pages, scale)


def _store(
    cache: torch.Tensor, scale: torch.Tensor | None, index: torch.Tensor, values: torch.Tensor
) -> None:
    """Real-valued pages [n, KVH, P, D] into `cache`, quantized as a prefill store would."""
    if cache.dtype != fp8_kv.FP8_DTYPE:
        cache[index] = values.to(cache.dtype)
        return
    num_pages, num_kv_heads, page_size, head_dim = values.shape
    slot_pages = index.repeat_interleave(page_size)
    slot_offsets = torch.arange(page_size, device=index.device).repeat(num_pages)
    # [n, KVH, P, D] -> [n * P, KVH, D]: one row per stored token, as the store path takes them
    rows = values.transpose(1, 2).reshape(num_pages * page_size, num_kv_heads, head_dim)
    store_fp8(cache, scale, slot_pages, slot_offsets, rows.contiguous())


def _scale(scale: torch.Tensor | None) -> torch.Tensor:
    assert scale is not None, "an fp8 cache without scales"
    return scale


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    array: Any = flat.numpy()
    return memoryview(array).cast("B")


def _tensor(frame: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only buffer: landing only reads it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(frame, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)
