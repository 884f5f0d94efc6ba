"""Zero-copy numpy views of KV pages, scales and queries for the Numba decode kernel: the raw
element type each cache dtype is handed in as, and how a scale tensor splits into dynamic
per-token scales and a static multiplier."""

from __future__ import annotations

import numpy as np
import torch

from densa.formats.fp8_kv import EXPONENT_SCALE_DTYPE
from densa.formats.kv_format import KVFormat, is_layer_scale

NO_SCALES = np.empty((0, 0, 0), dtype=np.float32)  # "no dynamic scales" placeholder

# Raw element type handed to Numba per cache dtype, and the constant its widened value must be
# multiplied by. bf16 goes in as int16 (not uint16) only so it gets a different specialization
# than fp16.
RAW_VIEW: dict[torch.dtype, tuple[torch.dtype, float]] = {
    torch.float32: (torch.float32, 1.0),
    torch.bfloat16: (torch.int16, 1.0),
    torch.float16: (torch.uint16, 1.0),
    # e4m3 bits are re-packed into fp16 bits whose exponent bias is 8 larger, so the widened value
    # is the true value / 256; the 256 is folded into the scales instead of paid per element.
    torch.float8_e4m3fn: (torch.uint8, 256.0),
    torch.int8: (torch.int8, 1.0),  # INT8 KV codes; their fp16 row scales are dynamic scales
}


def as_numpy(tensor: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """Zero-copy numpy view when `tensor` already has `dtype` and is contiguous (the hot path:
    checking first skips torch's per-call dispatch of no-op conversions)."""
    if tensor.dtype != dtype or not tensor.is_contiguous():
        tensor = tensor.to(dtype).contiguous()
    return tensor.numpy()


def raw_cache(cache: torch.Tensor) -> tuple[np.ndarray, float]:
    """Zero-copy numpy view of a cache in the element type `widen` expects, plus its factor."""
    if cache.dtype not in RAW_VIEW:
        raise TypeError(f"unsupported KV cache dtype {cache.dtype}")
    if not cache.is_contiguous():
        raise ValueError("KV cache must be contiguous")
    raw_dtype, factor = RAW_VIEW[cache.dtype]
    return cache.view(raw_dtype).numpy(), factor


def split_scale(
    scale: torch.Tensor | None, cache: torch.Tensor, kv_format: KVFormat | None
) -> tuple[np.ndarray, float]:
    """(dynamic per-token scales [P, Hkv, S] or an empty array, static multiplier)."""
    if scale is None:
        return NO_SCALES, 1.0
    if is_layer_scale(scale, kv_format):
        return NO_SCALES, float(scale)
    if scale.shape != cache.shape[:3]:
        raise ValueError(f"dynamic scales must be shaped {tuple(cache.shape[:3])}")
    if scale.dtype == EXPONENT_SCALE_DTYPE:
        if not scale.is_contiguous():
            raise ValueError("dynamic scale exponents must be contiguous")
        return scale.numpy(), 1.0
    if scale.dtype == torch.float16 and scale.is_contiguous():  # INT8 KV: widened in registers
        return scale.view(torch.uint16).numpy(), 1.0
    return as_numpy(scale, torch.float32), 1.0
