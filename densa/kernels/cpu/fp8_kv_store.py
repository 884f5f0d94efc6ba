"""The fused Numba kernels of the CPU FP8 KV store (kv_store.store_fp8 calls them): one call
quantizes a layer's new K or V rows and scatters them into their pages, matching the torch
references of densa.formats.fp8_kv bit for bit (tests/quant/test_fp8_kv.py).

A module of its own so that importing kv_store does not import Numba (~55 MiB resident): a
server whose caches are INT8 or unscaled never runs these.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from densa.formats.fp8_kv import FP8_MAX, MAX_SCALE_EXPONENT, MIN_SCALE_EXPONENT

_FLT_MAX = np.float32(3.4028234663852886e38)
_MIN_NORMAL_E4M3 = np.float32(2.0**-6)
_FP8_MAX = np.float32(FP8_MAX)


def _bits_typer(typingctx, x):
    """float32 -> its IEEE bits as uint32 (a register bitcast)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    if x != types.float32:
        return None
    return types.uint32(x), codegen


def _from_bits_typer(typingctx, bits):
    """uint32 IEEE bits -> float32 (a register bitcast)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    if bits != types.uint32:
        return None
    return types.float32(bits), codegen


# Typed as Any: mypy cannot see through numba's intrinsic wrapper.
_f32_bits: Any = intrinsic(_bits_typer)
_f32_from_bits: Any = intrinsic(_from_bits_typer)


@njit(cache=True, inline="always", nogil=True)
def _finite(x):
    """NaN -> 0, +-inf -> +-FLT_MAX (what torch.nan_to_num does in the reference)."""
    if x != x:
        return np.float32(0.0)
    return max(min(x, _FLT_MAX), -_FLT_MAX)


@njit(cache=True, inline="always", nogil=True)
def _encode_e4m3(y):
    """float32 y with |y| <= 448 -> float8_e4m3fn bits, rounding to nearest even like torch.

    Normal range: round the float32 mantissa to 3 bits on the bit pattern (add half an e4m3 ulp
    minus one, plus the kept lsb) and rebias the exponent (127 -> 7). Below e4m3's smallest normal
    (2**-6) the codes are multiples of 2**-9, so the code is rint(|y| * 512).
    """
    bits = _f32_bits(y)
    sign = (bits >> np.uint32(24)) & np.uint32(0x80)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    if abs(y) < _MIN_NORMAL_E4M3:
        code = np.uint32(np.rint(abs(y) * np.float32(512.0)))
    else:
        lsb = (magnitude >> np.uint32(20)) & np.uint32(1)
        code = ((magnitude + np.uint32(0x7FFFF) + lsb) >> np.uint32(20)) - np.uint32(960)
    return np.uint8(sign | code)


@njit(cache=True, inline="always", nogil=True)
def _row_exponent(amax):
    """The int8 exponent e of `scale_exponents` for one row maximum, from its float32 bits:
    amax = 1.m * 2**(b - 127), and e = b - 135, plus 1 when 1.m > 1.75 (so amax > 448 * 2**e).
    A subnormal amax (b = 0) gives e < -126, clamped like the reference's."""
    if amax == 0:
        return 0
    bits = _f32_bits(amax)
    biased = np.int32(bits >> np.uint32(23))
    exponent = biased - 135 + (1 if (bits & np.uint32(0x7FFFFF)) > 0x600000 else 0)
    return max(MIN_SCALE_EXPONENT, min(MAX_SCALE_EXPONENT, exponent))


@njit(cache=True, nogil=True)
def store_exponent_kernel(x, cache, exponents, pages, offsets):
    """Dynamic scales: per (token, head) row, pick the exponent, scale exactly, encode, scatter.

    x: float32 [T, H, D]; cache: uint8 [P, H, S, D]; exponents: int8 [P, H, S]."""
    num_tokens, num_heads, head_dim = x.shape
    for t in range(num_tokens):
        page, slot = pages[t], offsets[t]
        for h in range(num_heads):
            amax = np.float32(0.0)
            for d in range(head_dim):
                amax = max(amax, abs(_finite(x[t, h, d])))
            e = _row_exponent(amax)
            inv_scale = _f32_from_bits(np.uint32((127 - e) << 23))  # 2**-e, exact
            for d in range(head_dim):
                y = min(max(_finite(x[t, h, d]) * inv_scale, -_FP8_MAX), _FP8_MAX)
                cache[page, h, slot, d] = _encode_e4m3(np.float32(y))
            exponents[page, h, slot] = e


@njit(cache=True, nogil=True)
def store_static_kernel(x, cache, inv_scale, pages, offsets):
    """Static scale: fp8(clamp(x * inv_scale)) into each token's slot. x: float32 [T, H, D]."""
    num_tokens, num_heads, head_dim = x.shape
    for t in range(num_tokens):
        page, slot = pages[t], offsets[t]
        for h in range(num_heads):
            for d in range(head_dim):
                y = _finite(x[t, h, d]) * inv_scale
                y = min(max(y, -_FP8_MAX), _FP8_MAX) if y == y else np.float32(0.0)
                cache[page, h, slot, d] = _encode_e4m3(np.float32(y))
