"""FP8 (e4m3) KV cache: the scale policies, and quantizing K/V into pages as they are stored.

A page stores `torch.float8_e4m3fn` values; real value = stored.float() * scale, where the scale is

    static    one float32 per layer for K and one for V (0-dim tensors), calibrated offline over
              real text (`densa calibrate-kv`) and loaded from a JSON file (`KVScales`); 1.0 when
              no file is given. Costs no bytes per token.
    dynamic   one power-of-two scale per (token, kv head), chosen when the token is stored so the
              row's absolute maximum lands in (224, 448], the top binade of e4m3. Kept as its
              int8 exponent in the page's scale tensor [num_pages, num_kv_heads, page_size].

Why power-of-two exponents for dynamic scales: one byte per 64-128 values instead of four (for
head_dim 64 that is 65 bytes per head row instead of 68: 1.97x the resident tokens of BF16, not
1.88x), and scaling by 2**e is exact, so a row keeps e4m3's full relative precision (3 mantissa
bits) whatever its magnitude; only the choice of binade, not the scale's own rounding, matters.

Reading (dequantizing inside attention) is the kernels' job (densa.kernels); this module owns the
write side: a fused Numba kernel for CPU caches (one call quantizes and scatters a layer's new K
or V) and, for other devices, the torch reference in `densa.kernels.paged_attention_ref`, which
the kernel matches bit for bit (tests/quant/test_fp8_kv.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from densa.kernels.paged_attention_ref import (
    EXPONENT_SCALE_DTYPE,
    FP8_DTYPE,
    FP8_MAX,
    MAX_SCALE_EXPONENT,
    MIN_SCALE_EXPONENT,
    quantize_fp8_exponent,
    quantize_fp8_static,
)

KV_DTYPE = "fp8_e4m3"
SCALE_POLICIES = ("dynamic", "static")
# Bytes of scale per (token, kv head) and per K or V in each layer.
SCALE_BYTES = {"dynamic": 1, "static": 0}

_FLT_MAX = np.float32(3.4028234663852886e38)
_MIN_NORMAL_E4M3 = np.float32(2.0**-6)
_FP8_MAX = np.float32(FP8_MAX)


def scale_bytes_per_token(num_layers: int, num_kv_heads: int, policy: str) -> int:
    """Bytes the scales add to one cached token (K and V, all layers)."""
    if policy not in SCALE_BYTES:
        raise ValueError(f"kv scale policy must be one of {SCALE_POLICIES}, got {policy!r}")
    return 2 * num_layers * num_kv_heads * SCALE_BYTES[policy]


def fp8_support_error(device: torch.device) -> str | None:
    """Why an FP8 KV cache cannot run on `device` with this torch build, or None if it can."""
    alternative = "use --kv-cache-dtype bfloat16 (half FP8's capacity, no quantization)"
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        return (
            f"--kv-cache-dtype fp8_e4m3 needs torch.float8_e4m3fn, which torch {torch.__version__}"
            f" lacks; {alternative}, or install torch >= 2.1"
        )
    try:
        probe = torch.tensor([1.5, -448.0], device=device).to(dtype).to(torch.float32)
        works = probe.cpu().tolist() == [1.5, -448.0]
    except (RuntimeError, TypeError) as exc:
        return f"--kv-cache-dtype fp8_e4m3 does not run on {device} here ({exc}); {alternative}"
    if not works:
        return f"float8_e4m3fn casts are wrong on {device} in this build; {alternative}"
    return None


# ---- static scales: one per layer for K and for V, saved as JSON --------------------------------
SCALES_FORMAT = "densa-kv-scales/1"


@dataclass(frozen=True)
class KVScales:
    """Per-layer static scales (real = fp8 * scale), from a calibration pass or a file.

    Calibrated scales are the smallest powers of two with amax <= 448 * scale: scaling stays
    exact, and values up to 1-2x beyond anything seen in calibration still fit before clamping.
    """

    k: tuple[float, ...]
    v: tuple[float, ...]
    source: str = "default 1.0 (no scales file)"
    calibration: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise ValueError("need as many K scales as V scales")
        if not all(math.isfinite(s) and s > 0 for s in (*self.k, *self.v)):
            raise ValueError("KV scales must be finite and > 0")

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @classmethod
    def ones(cls, num_layers: int) -> KVScales:
        return cls(k=(1.0,) * num_layers, v=(1.0,) * num_layers)

    @classmethod
    def from_amax(
        cls, k_amax: Sequence[float], v_amax: Sequence[float], calibration: dict[str, Any]
    ) -> KVScales:
        """Scales from the per-layer absolute maxima of K and V seen over calibration text."""
        info = {**calibration, "k_amax": list(k_amax), "v_amax": list(v_amax)}
        return cls(
            k=tuple(_pow2_scale(a) for a in k_amax),
            v=tuple(_pow2_scale(a) for a in v_amax),
            source="calibration",
            calibration=info,
        )

    @classmethod
    def load(cls, path: str | Path, num_layers: int) -> KVScales:
        """Read a scales file; ValueError says what is wrong with it."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read KV scales from {path}: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != SCALES_FORMAT:
            raise ValueError(f"{path} is not a {SCALES_FORMAT} file (made by densa calibrate-kv)")
        try:
            k, v = tuple(map(float, data["k_scale"])), tuple(map(float, data["v_scale"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"cannot read KV scales from {path}: {exc!r}") from exc
        if len(k) != num_layers or len(v) != num_layers:
            raise ValueError(
                f"{path} has scales for {len(k)} layers but the model has {num_layers}; "
                "calibrate for this model with `densa calibrate-kv`"
            )
        return cls(k, v, source=str(path), calibration=data.get("calibration", {}))

    def save(self, path: str | Path) -> None:
        data = {
            "format": SCALES_FORMAT,
            "kv_cache_dtype": KV_DTYPE,
            "meaning": "real value = stored fp8 value * scale; one K and one V scale per layer",
            "k_scale": list(self.k),
            "v_scale": list(self.v),
            "calibration": self.calibration,
        }
        Path(path).write_text(json.dumps(data, indent=2) + "\n")


def _pow2_scale(amax: float) -> float:
    """The smallest power of two s with amax <= 448 * s (1.0 for a layer that saw only zeros)."""
    if not amax > 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax / FP8_MAX))


# ---- storing ---------------------------------------------------------------------------------
def store_fp8(
    cache: torch.Tensor,
    scale: torch.Tensor | None,
    pages: torch.Tensor,
    offsets: torch.Tensor,
    x: torch.Tensor,
) -> None:
    """Quantize x [T, KVH, D] into slot (pages[t], offsets[t]) of an fp8 cache [P, KVH, S, D].

    `scale`: an int8 exponent tensor [P, KVH, S] (dynamic; filled here), or a 0-dim float scale
    (static), or None (static 1.0). Values beyond the range are clamped; NaN is stored as 0.
    """
    if cache.dtype != FP8_DTYPE:
        raise TypeError(f"store_fp8 writes float8_e4m3fn caches, not {cache.dtype}")
    if scale is None:
        scale = torch.tensor(1.0)
    if cache.device.type == "cpu" and cache.is_contiguous():
        _store_cpu(cache, scale, pages, offsets, x)
        return
    if scale.dim() == 0:
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
) -> None:
    rows = x if x.dtype == torch.float32 else x.float()
    raw = cache.view(torch.uint8).numpy()
    pages_np, offsets_np = pages.numpy(), offsets.numpy()
    if scale.dim() == 0:
        inv_scale = np.float32(torch.reciprocal(scale.float()).item())
        _store_static_kernel(rows.numpy(), raw, inv_scale, pages_np, offsets_np)
    else:
        if scale.dtype != EXPONENT_SCALE_DTYPE or not scale.is_contiguous():
            raise ValueError("dynamic fp8 scales must be a contiguous int8 exponent tensor")
        _store_exponent_kernel(rows.numpy(), raw, scale.numpy(), pages_np, offsets_np)


# ---- the fused CPU kernels -------------------------------------------------------------------
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


@njit(cache=True, inline="always")
def _finite(x):
    """NaN -> 0, +-inf -> +-FLT_MAX (what torch.nan_to_num does in the reference)."""
    if x != x:
        return np.float32(0.0)
    return max(min(x, _FLT_MAX), -_FLT_MAX)


@njit(cache=True, inline="always")
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


@njit(cache=True, inline="always")
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


@njit(cache=True)
def _store_exponent_kernel(x, cache, exponents, pages, offsets):
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


@njit(cache=True)
def _store_static_kernel(x, cache, inv_scale, pages, offsets):
    """Static scale: fp8(clamp(x * inv_scale)) into each token's slot. x: float32 [T, H, D]."""
    num_tokens, num_heads, head_dim = x.shape
    for t in range(num_tokens):
        page, slot = pages[t], offsets[t]
        for h in range(num_heads):
            for d in range(head_dim):
                y = _finite(x[t, h, d]) * inv_scale
                y = min(max(y, -_FP8_MAX), _FP8_MAX) if y == y else np.float32(0.0)
                cache[page, h, slot, d] = _encode_e4m3(np.float32(y))
