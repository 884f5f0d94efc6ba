"""INT8 KV cache: one int8 code per value and one fp16 scale per (token, kv head) row.

    scale = fp16(max_d |x[d]| / 127)      code[d] = clamp(round(x[d] / scale), -127, 127)
    real value = code * scale             (readers: cache.float() * scale, like every scaled cache)

Why not FP8 (e4m3): e4m3 keeps 3 mantissa bits, so every stored value is off by up to 1/16 of
itself; 8 bits spent uniformly over a row's range err by at most 1/254 of the row's largest
value. On SmolLM2's K/V rows that is ~2-2.5x less RMS error, and 11x less KL against a BF16
cache (docs/kv-cache.md, 20k LAMBADA tokens: KL 0.00021 vs 0.00226, top-1 agreement 99.0% vs
96.9%). The fp16 scale adds 2 bytes per 64-value row: 66 bytes vs BF16's 128, 1.94x the
resident tokens (e4m3 with power-of-two exponents: 65 bytes, 1.97x).

Stores here are torch ops (prefill, page copies, the eager decode path); the fused C++ decode
step (densa/kernels/cpu/csrc/decoder.cpp) stores the same codes and scales bit for bit.
"""

from __future__ import annotations

import torch

KV_DTYPE = "int8"
CODE_DTYPE = torch.int8
SCALE_DTYPE = torch.float16
SCALE_BYTES = 2  # per (token, kv head), for K and for V
CODE_MAX = 127
# Rows are clamped so the largest magnitude's scale stays a finite fp16 (65504 * 127).
_ROW_LIMIT = 65504.0 * CODE_MAX


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (int8 codes [..., D], fp16 scales [...]). NaN is stored as 0; an
    all-zero row gets scale 0 and codes 0."""
    finite = torch.nan_to_num(x.float(), nan=0.0).clamp(-_ROW_LIMIT, _ROW_LIMIT)
    scale = (finite.abs().amax(-1) / CODE_MAX).to(SCALE_DTYPE)
    wide = scale.float().unsqueeze(-1)
    codes = torch.where(wide > 0, finite / torch.where(wide > 0, wide, 1.0), 0.0)
    return torch.round(codes).clamp(-CODE_MAX, CODE_MAX).to(CODE_DTYPE), scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float().unsqueeze(-1)


def store_int8(
    cache: torch.Tensor,
    scale: torch.Tensor,
    pages: torch.Tensor,
    offsets: torch.Tensor,
    x: torch.Tensor,
) -> None:
    """Quantize x [T, KVH, D] into slot (pages[t], offsets[t]) of an int8 cache [P, KVH, S, D]
    and its fp16 scales [P, KVH, S]."""
    if cache.dtype != CODE_DTYPE or scale.dtype != SCALE_DTYPE:
        raise TypeError("store_int8 writes int8 caches with fp16 scales")
    codes, row_scale = quantize_rows(x)
    cache[pages, :, offsets] = codes
    scale[pages, :, offsets] = row_scale


def scale_bytes_per_token(num_layers: int, num_kv_heads: int) -> int:
    return 2 * num_layers * num_kv_heads * SCALE_BYTES
