"""FP4 (E2M1) weights with block scales, as MXFP4 and NVFP4 checkpoints ship them: the storage
layout, the reference dequantization and round-to-nearest quantizers, shared by the kernels
that read them (densa/kernels/cpu/qgemm.py, densa/kernels/triton/fp4_linear.py) and the
loaders and quantizers that write them (densa/quant/fp4_weights.py and the shipped-format loader).

Element (OCP Microscaling Formats spec v1.0, sec. 5.3.3): E2M1, 1 sign, 2 exponent (bias 1),
1 mantissa bit, no Inf or NaN. The 16 codes:

    code  0    1    2    3    4    5    6    7  |  8 .. 15: the same, negative (8 is -0)
    value 0   0.5  1.0  1.5  2.0  3.0  4.0  6.0

Storage, row-major like densa's INT4 (one row per output feature, so fused projections
concatenate row by row):

    qweight [N, K/2] uint8   two codes per byte: column 2j in the low nibble, 2j + 1 high
                             (gpt-oss's `*_blocks` [.., K/32, 16] is this array reshaped)
    scales  [N, K/g] uint8   one scale byte per group of g inputs

    MXFP4 (g = 32): scale E8M0 (sec. 5.4.1), 2^(s - 127); s = 0xFF is NaN, and a NaN scale
                    makes every element of its block NaN (sec. 6.3). So 2^-127 (s = 0, a
                    float32 subnormal) .. 2^127; no zero scale.
        w[n, k] = e2m1(q[n, k]) * 2^(s[n, k // 32] - 127)          exact in float32, except
                    where the true value overflows it (s >= 253 with |e2m1| >= 4): Inf
    NVFP4 (g = 16): scale E4M3 (float8_e4m3fn: bias 7, subnormals, 0x7F / 0xFF NaN, no Inf),
                    times one float32 per tensor t (ModelOpt's weight_scale_2); densa keeps t
                    per row, so a fused q|k|v keeps each part's own
        w[n, k] = e2m1(q[n, k]) * (e4m3(s[n, k // 16]) * t[n])      both products rounded
                    to float32, in this order, as ModelOpt computes it
                    (compressed-tensors divides by its global scale instead: `divide=True`)

What differs between the two is one value, `Fp4Scheme.MXFP4` / `Fp4Scheme.NVFP4` (group, scale
encoding, the tensor scale, bits per weight, the producers' names for it, its quantizer and
reference): callers ask it instead of comparing names, which are parsed once at the edges
(`Fp4Scheme.named` for WeightFormat.kind and the options, `of_compressed_tensors`).

transformers' gpt-oss reader (integrations/mxfp4.py) computes ldexp(e2m1, s - 127), which
gives Inf (or 0 for a zero code) for s = 0xFF where the spec says NaN; densa follows the spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

MXFP4_GROUP = 32
NVFP4_GROUP = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_NAN = 0xFF
E8M0_BIAS = 127
# e2m1 values by code; twice them are the integers {0, 1, 2, 3, 4, 6, 8, 12} the int8 kernels use.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip


# ---- elements ----------------------------------------------------------------------------------
def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (any integer dtype) -> their float32 values (-0.0 for code 8)."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes 0..15 (K even) -> [..., K/2] uint8, even columns in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] uint8 codes."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def quantize_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float values (already divided by their scale) -> e2m1 codes: round to nearest, ties to
    even mantissa (the spec's rounding), saturating at +-6; NaN becomes 0."""
    magnitude = x.abs().float().nan_to_num(0.0).clamp(max=E2M1_MAX)
    # Midpoints between neighbours; at a tie the even neighbour (mantissa 0) wins: 0.25 -> 0,
    # 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
    above = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
    ties_up = (False, True, False, True, False, True, False)  # tie rounds to the upper value
    code = torch.zeros(x.shape, dtype=torch.uint8)
    for midpoint, up in zip(above, ties_up, strict=True):
        code += (magnitude >= midpoint) if up else (magnitude > midpoint)
    negative = torch.signbit(x.float()) & (code > 0)  # -0.0 is kept as +0 (code 0)
    return code | (negative.to(torch.uint8) << 3)


# ---- scales ------------------------------------------------------------------------------------
def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 2^(s - 127): 0x00 is 2^-127 (subnormal), 0xFF NaN."""
    exponent = scales.to(torch.int32) - E8M0_BIAS
    value = torch.ldexp(torch.ones(scales.shape, dtype=torch.float32), exponent)
    return torch.where(scales.to(torch.int32) == E8M0_NAN, torch.nan, value)


def e4m3_to_float(bits: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bit patterns (uint8) -> float32, from the format's definition: sign,
    4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m * 2^-9); S.1111.111
    is NaN; no Inf."""
    b = bits.to(torch.int32)
    sign = torch.where(b >= 0x80, -1.0, 1.0)
    exponent, mantissa = (b >> 3) & 0xF, (b & 0x7).float()
    normal = torch.ldexp(1.0 + mantissa / 8.0, exponent - 7)
    subnormal = torch.ldexp(mantissa, torch.full_like(exponent, -9))
    value = sign * torch.where(exponent == 0, subnormal, normal)
    return torch.where((b & 0x7F) == 0x7F, torch.nan, value)


def float_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float -> e4m3 bit patterns (uint8), round to nearest even, saturating at +-448."""
    clamped = x.float().clamp(-E4M3_MAX, E4M3_MAX)
    return clamped.to(torch.float8_e4m3fn).view(torch.uint8)


# ---- dequantization (the reference) -------------------------------------------------------------
def expand(values: torch.Tensor, group: int) -> torch.Tensor:
    """[..., G] per-group values -> [..., G * group], each repeated over its group."""
    return values.repeat_interleave(group, dim=-1)


def dequantize_mxfp4(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """qweight [..., K/2] uint8, scales [..., K/32] E8M0 -> [..., K] float32."""
    values = e2m1_to_float(unpack_fp4(qweight))
    return values * expand(e8m0_to_float(scales), MXFP4_GROUP)


def nvfp4_block_scales(
    scales: torch.Tensor, tensor_scale: torch.Tensor, divide: bool = False
) -> torch.Tensor:
    """scales [..., K/16] e4m3 bits, tensor_scale [...] (one per row) or [] / [1] -> the
    float32 scale of each block: e4m3 * t (or e4m3 / t, compressed-tensors' global scale)."""
    block = e4m3_to_float(scales)
    t = tensor_scale.float()
    t = t.reshape(-1)[0] if t.numel() == 1 else t.unsqueeze(-1)
    return block / t if divide else block * t


def dequantize_nvfp4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    tensor_scale: torch.Tensor,
    divide: bool = False,
) -> torch.Tensor:
    """qweight [..., K/2] uint8, scales [..., K/16] e4m3 bits, tensor_scale per row or per
    tensor -> [..., K] float32."""
    values = e2m1_to_float(unpack_fp4(qweight))
    return values * expand(nvfp4_block_scales(scales, tensor_scale, divide), NVFP4_GROUP)


# ---- round-to-nearest quantizers ---------------------------------------------------------------
def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float (K % 32 == 0) -> (qweight [..., K/2], scales [..., K/32] E8M0), round to
    nearest. The shared exponent is the spec's (sec. 6.3: floor(log2 max|v|) - 2, e2m1's
    largest exponent), one higher where the block's largest value would reach 7x the scale: the
    spec's choice clips everything in [6, 8) x scale to 6, an error up to 2 steps' worth, where
    one exponent up rounds it with at most half a step (compressed-tensors rounds the block
    maximum the same way). An all-zero block gets the smallest scale, 2^-127."""
    groups = weight.float().unflatten(-1, (-1, MXFP4_GROUP))  # [..., G, 32]
    amax = groups.abs().amax(-1)
    mantissa, exponent = torch.frexp(amax)  # amax = m 2^e, m in [0.5, 1): floor(log2) = e - 1
    shared = exponent - 1 - 2 + (mantissa >= 7 / 8).to(exponent.dtype)
    shared = torch.where(amax > 0, shared, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
    scale = torch.ldexp(torch.ones_like(amax), shared)
    codes = quantize_e2m1(groups / scale.unsqueeze(-1)).flatten(-2)
    return pack_fp4(codes), (shared + E8M0_BIAS).to(torch.uint8)


def nvfp4_tensor_scale(weight: torch.Tensor) -> torch.Tensor:
    """ModelOpt's per-tensor scale: max|w| / (6 * 448), so the largest block scale is e4m3's
    largest value (1.0 for an all-zero tensor)."""
    amax = float(weight.abs().max()) if weight.numel() else 0.0
    return torch.tensor(amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else 1.0, dtype=torch.float32)


def quantize_nvfp4(
    weight: torch.Tensor, tensor_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float (K % 16 == 0) -> (qweight [N, K/2], scales [N, K/16] e4m3 bits, the
    tensor's float32 scale), as ModelOpt does: block scale amax / 6 / t rounded to e4m3, the
    elements rounded to nearest e2m1 after dividing by (e4m3 * t)."""
    t = nvfp4_tensor_scale(weight) if tensor_scale is None else tensor_scale.float().reshape(())
    groups = weight.float().unflatten(-1, (-1, NVFP4_GROUP))  # [..., G, 16]
    block = float_to_e4m3(groups.abs().amax(-1) / E2M1_MAX / t)
    scale = e4m3_to_float(block) * t
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = quantize_e2m1(torch.where(scale.unsqueeze(-1) > 0, groups / safe.unsqueeze(-1), 0.0))
    return pack_fp4(codes.flatten(-2)), block, t


# (qweight, scales, the tensor's float32 scale: None for a scheme without one)
Fp4Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


# ---- the two schemes, as values -----------------------------------------------------------------
@dataclass(frozen=True)
class Fp4Scheme:
    """What differs between MXFP4 and NVFP4, held once: callers ask the scheme (its group, its
    scale bytes, whether a tensor scale exists, its quantizer and reference) instead of comparing
    names. The names are for the edges only: WeightFormat.kind in checkpoint metadata, the
    options, and the producers' configs (`named`, `of_compressed_tensors`) parse them."""

    MXFP4: ClassVar[Fp4Scheme]
    NVFP4: ClassVar[Fp4Scheme]

    name: str  # densa's name: WeightFormat.kind, `--weight-format`, `densa quantize --weights`
    group: int  # inputs sharing one scale byte
    scale_encoding: str  # how a scale byte reads: "e8m0" (a power of two) or "e4m3"
    has_tensor_scale: bool  # a float32 per tensor (densa keeps it per row) times the block scales
    # compressed-tensors' names: quantization_config.format and the weights' strategy
    compressed_tensors_format: str
    compressed_tensors_strategy: str
    modelopt_algo: str | None  # ModelOpt's quant_algo (None: ModelOpt does not ship it)

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight: 4 + 8 / group (NVFP4's per-tensor scale aside)."""
        return 4 + 8 / self.group

    def quantize(self, weight: torch.Tensor) -> Fp4Parts:
        """[N, K] float -> (qweight, scales, the tensor's float32 scale or None), by round to
        nearest."""
        if self.has_tensor_scale:
            return quantize_nvfp4(weight)
        return (*quantize_mxfp4(weight), None)

    def dequantize(
        self, qweight: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The reference: qweight [..., K/2], scales [..., K/g] (and NVFP4's tensor scale, per
        row or per tensor) -> [..., K] float32."""
        if not self.has_tensor_scale:
            return dequantize_mxfp4(qweight, scales)
        if tensor_scale is None:
            raise ValueError(f"{self.name} weights need their tensor scale")
        return dequantize_nvfp4(qweight, scales, tensor_scale)

    def describe(self, suffix: str = "") -> str:
        """'mxfp4 (e2m1, e8m0 scale per 32)': for logs and reports (`suffix` inside the
        parentheses)."""
        tensor = ", fp32 per tensor" if self.has_tensor_scale else ""
        return f"{self.name} (e2m1, {self.scale_encoding} scale per {self.group}{tensor}{suffix})"

    @classmethod
    def named(cls, name: str) -> Fp4Scheme | None:
        """The scheme densa's name (a WeightFormat kind) stands for; None for other kinds."""
        return _SCHEMES.get(name)

    @classmethod
    def of_compressed_tensors(cls, format_name: str | None) -> Fp4Scheme | None:
        """The scheme a compressed-tensors `format` names, or None for other formats."""
        return next((s for s in _SCHEMES.values() if s.compressed_tensors_format == format_name),
                    None)  # fmt: skip


Fp4Scheme.MXFP4 = Fp4Scheme("mxfp4", MXFP4_GROUP, "e8m0", False, "mxfp4-pack-quantized",
                            "group", None)  # fmt: skip
Fp4Scheme.NVFP4 = Fp4Scheme("nvfp4", NVFP4_GROUP, "e4m3", True, "nvfp4-pack-quantized",
                            "tensor_group", "NVFP4")  # fmt: skip
_SCHEMES = {s.name: s for s in (Fp4Scheme.MXFP4, Fp4Scheme.NVFP4)}
FP4_SCHEME_NAMES = tuple(_SCHEMES)
