"""Storing K/V into pages as their KVFormat says (`store_kv`), off the GPU's Triton path: FP8
(e4m3) pages through a fused Numba kernel for CPU caches (fp8_kv_store, imported on the first
FP8 store: one call quantizes and scatters a layer's new K or V) and the torch references of
`densa.formats.fp8_kv` elsewhere, which the kernel matches bit for bit
(tests/quant/test_fp8_kv.py); INT8 and unscaled pages through torch.
The formats themselves -- scale policies, constants, reference quantizers -- are densa.formats'.
"""

from __future__ import annotations

import numpy as np
import torch

from densa.formats.fp8_kv import (
    EXPONENT_SCALE_DTYPE,
    FP8_DTYPE,
    quantize_fp8_exponent,
    quantize_fp8_static,
)
from densa.formats.int8_kv import store_int8
from densa.formats.kv_format import ROW, KVFormat


# ---- storing ---------------------------------------------------------------------------------
def store_kv(
    kv_format: KVFormat,
    pages: torch.Tensor,
    scale: torch.Tensor | None,
    slot_pages: torch.Tensor,
    slot_offsets: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    """Write rows [T, H, D] into slot (slot_pages[t], slot_offsets[t]) of pages [P, H, S, D],
    quantizing (and filling per-row scales) as `kv_format` says."""
    if kv_format.is_fp8:
        store_fp8(pages, scale, slot_pages, slot_offsets, rows, kv_format)
    elif kv_format.scales == ROW:
        if scale is None:
            raise ValueError("int8 pages need their fp16 row scales")
        store_int8(pages, scale, slot_pages, slot_offsets, rows)
    else:
        pages[slot_pages, :, slot_offsets] = rows.to(pages.dtype)


def store_fp8(
    cache: torch.Tensor,
    scale: torch.Tensor | None,
    pages: torch.Tensor,
    offsets: torch.Tensor,
    x: torch.Tensor,
    kv_format: KVFormat | None = None,
) -> None:
    """Quantize x [T, KVH, D] into slot (pages[t], offsets[t]) of an fp8 cache [P, KVH, S, D].

    `scale`: an int8 exponent tensor [P, KVH, S] (dynamic; filled here), or a 0-dim float scale
    (static), or None (static 1.0). Values beyond the range are clamped; NaN is stored as 0.
    `kv_format` says which (the engine's caches carry it); pages made by hand get it read off
    their tensors.
    """
    if cache.dtype != FP8_DTYPE:
        raise TypeError(f"store_fp8 writes float8_e4m3fn caches, not {cache.dtype}")
    static = (kv_format or KVFormat.of_tensors(cache, scale)).has_layer_scales
    if scale is None:
        scale = torch.tensor(1.0)
    if cache.device.type == "cpu" and cache.is_contiguous():
        _store_cpu(cache, scale, pages, offsets, x, static)
        return
    if static:
        cache[pages, :, offsets] = quantize_fp8_static(x, scale)
    else:
        values, exponents = quantize_fp8_exponent(x)
        cache[pages, :, offsets] = values
        scale[pages, :, offsets] = exponents


def _store_cpu(
    cache: torch.Tensor,
    scale: torch.Tensor,
    pages: torch.Tensor,
    offsets: torch.Tensor,
    x: torch.Tensor,
    static: bool,
) -> None:
    from densa.kernels.cpu import fp8_kv_store as kernels  # imports Numba: only for FP8 pages

    rows = x if x.dtype == torch.float32 else x.float()
    raw = cache.view(torch.uint8).numpy()
    pages_np, offsets_np = pages.numpy(), offsets.numpy()
    if static:
        inv_scale = np.float32(torch.reciprocal(scale.float()).item())
        kernels.store_static_kernel(rows.numpy(), raw, inv_scale, pages_np, offsets_np)
    else:
        if scale.dtype != EXPONENT_SCALE_DTYPE or not scale.is_contiguous():
            raise ValueError("dynamic fp8 scales must be a contiguous int8 exponent tensor")
        kernels.store_exponent_kernel(rows.numpy(), raw, scale.numpy(), pages_np, offsets_np)
