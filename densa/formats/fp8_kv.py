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

This module owns the format: the scale policies, its constants and the torch reference
quantizers. The kernels that read pages (attention) and write them (`densa.kernels.cpu.kv_store`,
a fused Numba store for CPU caches, bit for bit equal to the references here) live in kernels/.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
EXPONENT_SCALE_DTYPE = torch.int8  # dynamic scales stored as power-of-two exponents
# 2**-e stays a normal float32 and 448 * 2**e stays finite, so no scale or restored value
# is inf or subnormal: e in [-126, 119].
MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT = -126, 119


KV_DTYPE = "fp8_e4m3"
SCALE_POLICIES = ("dynamic", "static")
# Bytes of scale per (token, kv head) and per K or V in each layer.
SCALE_BYTES = {"dynamic": 1, "static": 0}


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


# ---- reference quantizers (torch; the kernels in densa.kernels.cpu.kv_store match them) ----
def quantize_fp8(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float32 x [..., D] to float8_e4m3fn; never yields NaN or inf.

    With `scale` None, the scale is dynamic per row: amax(|x|, -1) / 448 (shape x.shape[:-1]).
    Otherwise `scale` (0-dim) is used as a static scale. Returns (fp8 values, float32 scale).
    Non-finite inputs are first mapped to the largest finite float32 so the result stays finite.
    """
    x = torch.nan_to_num(x.to(torch.float32), nan=0.0)
    if scale is None:
        amax = x.abs().amax(dim=-1)
        # An all-zero row has no natural scale; any positive value quantizes it exactly to zero.
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        scaled = x / scale.unsqueeze(-1)
    else:
        scale = scale.to(torch.float32)
        scaled = x / scale
    # Clamp explicitly: saturation of float32 -> e4m3fn casts is not guaranteed across backends.
    scaled = torch.nan_to_num(scaled, nan=0.0).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(FP8_DTYPE), scale


def scale_exponents(amax: torch.Tensor) -> torch.Tensor:
    """int8 exponents e of the smallest power-of-two scales with amax <= 448 * 2**e.

    amax = m * 2**k with m in [0.5, 1) and 448 = 0.875 * 2**9, so e = k - 9 (m <= 0.875) or
    k - 8 (m > 0.875): the scaled row maximum lands in (224, 448], using e4m3's top binade.
    A zero row gets e = 0. Exponents are clamped to [-126, 119] (rows beyond that saturate).
    """
    mantissa, exponent = torch.frexp(amax.to(torch.float32))
    e = exponent - 9 + (mantissa > 0.875).to(exponent.dtype)
    e = torch.where(amax > 0, e, torch.zeros_like(e))
    return e.clamp(MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT).to(EXPONENT_SCALE_DTYPE)


def quantize_fp8_exponent(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float x [..., D] to float8_e4m3fn with one power-of-two scale per row.

    Returns (fp8 values, int8 exponents [...]); value = fp8 * 2**exponent. Scaling by a power of
    two is exact, so the only rounding is e4m3's own. Never yields NaN or inf (NaN -> 0, +-inf and
    huge values saturate at +-448 * 2**119).
    """
    finite = torch.nan_to_num(x.to(torch.float32), nan=0.0)
    exponents = scale_exponents(finite.abs().amax(dim=-1))
    scaled = torch.ldexp(finite, -exponents.to(torch.int32).unsqueeze(-1))
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), exponents


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize float x with one static scale (0-dim): fp8(clamp(x * (1 / scale))).

    Multiplying by the float32 reciprocal (not dividing) is what the fused store kernel does, so
    both round identically.
    """
    finite = torch.nan_to_num(x.to(torch.float32), nan=0.0)
    scaled = finite * torch.reciprocal(scale.to(torch.float32))
    return torch.nan_to_num(scaled, nan=0.0).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
