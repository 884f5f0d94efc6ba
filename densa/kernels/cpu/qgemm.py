"""W4A8, W5A8, W5MA8, W6A8, W6MA8, W8A8 and weight-only W8 matmuls (groups of 32): torch
references, packing, and the C++ kernels.

Arithmetic (llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0), for x [M, K] and weights [N, K]:

    W4: w[n, k] = d[n, g] * q[n, k] + m[n, g]    q in 0..15          g = k // 32
    W8: w[n, k] = d[n, g] * q[n, k]              q in -127..127
    W6: w[n, k] = d[n, g] * sc[n, k // 16] * q[n, k]    q in -32..31, sc int8 (GGUF's Q6_K;
        Q5_0 and Q4_0 with sc = 1)
    W6M: W6 + m[n, g]                            (GGUF's Q5_1 and Q5_K: 5-bit codes and a minimum)
    W5:  W6 with q in -16..15                    (GGUF's Q5_0, Q4_0 with sc = 1; Q3_K)
    W5M: W6M with q in 0..31                     (GGUF's Q5_1 and Q5_K, their codes as stored)
    x[t, k] ~ dx[t, g] * qx[t, k],  dx = max_k |x[t, k]| / 127 over the group, qx = round(x / dx)
    y[t, n] = sum_g dx d sum_k q qx  (+ m[n, g] dx sum_k qx for W4, W5M and W6M: the quantized
              x's sum, so the error is sum_k w (x^ - x) as for W8; see csrc/qgemm.cpp)

W5 / W5M hold their codes in one high bit less than W6 / W6M (6.0 and 6.5 bits per weight
against 7.0 and 7.5): the same arithmetic, so the W6 references and dequantizers serve them.

d and m are stored as fp16 (like the GGUF blocks). The C++ layout is described in
csrc/qgemm.cpp; the references here compute the same sums in float64 (exact for the integer
parts), so kernel and reference differ only by float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from densa.formats import fp4
from densa.formats.int4 import CODE_OFFSET, expand_groups, unpack_nibbles
from densa.kernels.cpu import native

GROUP = 32
PANEL = 16
HALF = 16  # inputs per W6 / W5 scale sc
W6_MIN = 7  # the "bits" code of W6 with a minimum (csrc/qgemm.h: kFormatW6MA8)
W5_MIN = 51  # the "bits" code of W5 with a minimum (csrc/qgemm.h: kFormatW5MA8)
W8_FLOAT = 80  # the "bits" code of weight-only W8 (csrc/qgemm.h: kFormatW8)
MXFP4A8 = 41  # FP4 weights, int8 activations (csrc/fp4gemm.cpp; densa.formats.fp4)
NVFP4A8 = 42
MXFP4 = 43  # the same blocks, float32 activations (weight-only)
NVFP4 = 44
FP4_WEIGHT_ONLY = {MXFP4A8: MXFP4, NVFP4A8: NVFP4}


def fits(in_features: int, out_features: int) -> bool:
    """Whether a [out, in] weight has the shape the kernels tile (K % 32, N % 16)."""
    return in_features % GROUP == 0 and out_features % PANEL == 0


# ---- activations -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Int8Activations:
    qx: torch.Tensor  # [M, K] int8
    dx: torch.Tensor  # [M, K/32] float32
    sumx: torch.Tensor  # [M, K/32] float32: dx * sum(qx), the sum of the quantized group


def quantize_activations(x: torch.Tensor) -> Int8Activations:
    """Per row and group of 32: symmetric int8 with scale max|x| / 127 (round half to even)."""
    rows, cols = x.shape
    groups = x.float().view(rows, cols // GROUP, GROUP)
    dx = groups.abs().amax(-1) / 127.0
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    qx = torch.round(groups * inv[..., None]).to(torch.int8).view(rows, cols)
    sumx = dx * qx.view(rows, cols // GROUP, GROUP).sum(-1, dtype=torch.int32).float()
    return Int8Activations(qx, dx, sumx)


# ---- references --------------------------------------------------------------------------------
def w4a8_reference(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
    """x [M, K] float32, codes [N, K] 0..15, d/m [N, K/32] (rounded to fp16 as stored)."""
    act = quantize_activations(x)
    d, m = d.half().double(), m.half().double()
    dots = _group_dots(act.qx, codes)  # [M, N, G]
    y = (dots * act.dx.double()[:, None, :] * d[None]).sum(-1)
    y += act.sumx.double() @ m.T
    return y.float()


def w8a8_reference(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32, codes [N, K] int8, d [N, K/32]."""
    act = quantize_activations(x)
    dots = _group_dots(act.qx, codes)
    return (dots * act.dx.double()[:, None, :] * d.half().double()[None]).sum(-1).float()


def w6a8_reference(
    x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, sc: torch.Tensor
) -> torch.Tensor:
    """x [M, K] float32, codes [N, K] -32..31 (W5: -16..15), d [N, K/32] (rounded to fp16 as
    stored), sc [N, K/16] int8: sc * codes is an exact integer weight per group, so the sums
    are exact."""
    act = quantize_activations(x)
    scaled = codes.double() * sc.double().repeat_interleave(HALF, dim=1)
    dots = _group_dots(act.qx, scaled)
    return (dots * act.dx.double()[:, None, :] * d.half().double()[None]).sum(-1).float()


def w6ma8_reference(
    x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, m: torch.Tensor
) -> torch.Tensor:
    """W6's reference plus m (rounded to fp16 as stored) times each group's quantized x sum
    (W5M: codes 0..31)."""
    act = quantize_activations(x)
    y = w6a8_reference(x, codes, d, sc).double() + act.sumx.double() @ m.half().double().T
    return y.float()


def mxfp4a8_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32, qweight [N, K/2] e2m1 codes, scales [N, K/32] E8M0: the int8-activation
    product the MXFP4A8 kernel computes, in float64 (a NaN scale makes its rows' outputs NaN)."""
    act = quantize_activations(x)
    values = fp4.e2m1_to_float(fp4.unpack_fp4(qweight)).double()  # [N, K], exact
    dots = _group_dots(act.qx, values)  # [M, N, G]
    scale = fp4.e8m0_to_float(scales).double()  # [N, G]
    return (dots * act.dx.double()[:, None, :] * scale[None]).sum(-1).float()


def nvfp4a8_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor
) -> torch.Tensor:
    """x [M, K] float32, qweight [N, K/2], scales [N, K/16] e4m3 bits, tensor_scale [N]: the
    NVFP4A8 kernel's product in float64 (each 16 inputs its own scale, then t per row)."""
    act = quantize_activations(x)
    rows, cols = act.qx.shape
    values = fp4.e2m1_to_float(fp4.unpack_fp4(qweight)).double()
    a = act.qx.double().view(rows, 1, cols // HALF, HALF)
    halves = (a * values.view(1, values.shape[0], cols // HALF, HALF)).sum(-1)  # [M, N, K/16]
    dx = act.dx.double().repeat_interleave(2, dim=1)  # [M, K/16]
    block = fp4.e4m3_to_float(scales).double()  # [N, K/16]
    y = (halves * dx[:, None, :] * block[None]).sum(-1)
    return (y * tensor_scale.double()[None, :]).float()


def _group_dots(qx: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """[M, K] x [N, K] integer codes -> [M, N, K/32] exact per-group dot products (float64)."""
    rows, cols = qx.shape
    a = qx.double().view(rows, 1, cols // GROUP, GROUP)
    b = codes.double().view(1, codes.shape[0], cols // GROUP, GROUP)
    return (a * b).sum(-1)


# ---- weights in the kernels' terms -------------------------------------------------------------
def int4_to_w4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    in_features: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """densa's INT4 layout (w = (q - 8) s + z, any group size dividing into 32s) -> W4 codes,
    d, m in groups of 32: d = s, m = z - 8 s. Exact: larger groups repeat their scales."""
    codes = unpack_nibbles(qweight, in_features)  # [N, K] 0..15
    repeat = group_size // GROUP
    num_groups = in_features // GROUP
    s = scales.float().repeat_interleave(repeat, dim=1)[:, :num_groups]
    z = torch.zeros_like(s) if zeros is None else zeros.float().repeat_interleave(repeat, 1)
    return codes, s, z[:, :num_groups] - CODE_OFFSET * s


def quantize_w8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense [N, K] weight -> int8 codes and fp16-representable d per group of 32 (Q8_0).

    A weight that came from a Q8_0 GGUF tensor comes back exactly: its group maximum is
    127 * d, so d and every code are recovered."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // GROUP, GROUP)
    d = (groups.abs().amax(-1) / 127.0).half().float()
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    codes = torch.round(groups * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.view(rows, cols), d


def dequantize_w4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    cols = codes.shape[1]
    return codes.float() * expand_groups(d.half().float(), GROUP, cols) + expand_groups(
        m.half().float(), GROUP, cols
    )


def dequantize_w8(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return codes.float() * expand_groups(d.half().float(), GROUP, codes.shape[1])


def dequantize_w6(codes: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """Exact in float32: d (fp16) times sc times the code needs 11 + 8 + 6 significant bits."""
    cols = codes.shape[1]
    scale = expand_groups(d.half().float(), GROUP, cols) * expand_groups(sc.float(), HALF, cols)
    return codes.float() * scale


def dequantize_w6m(
    codes: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, m: torch.Tensor
) -> torch.Tensor:
    """W6's weight (d sc code, exact) plus the fp16 minimum (one float32 rounding)."""
    return dequantize_w6(codes, d, sc) + expand_groups(m.half().float(), GROUP, codes.shape[1])


def quantize_w6(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dense [N, K] weight -> W6 codes (-32..31), d per 32 and sc per 16 inputs, round to
    nearest as llama.cpp's Q6_K (its scale search aside): each 16's value of largest magnitude
    becomes code -32, so both signs use the codes' full range; d = max |scale| / 127 per group."""
    return _quantize_signed_split(weight, 32)


def quantize_w5(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_w6 with 5-bit codes (-16..15): each 16's largest magnitude becomes -16."""
    return _quantize_signed_split(weight, 16)


def _quantize_signed_split(
    weight: torch.Tensor, offset: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    halves = weight.float().view(rows, cols // HALF, HALF)
    extreme = halves.gather(-1, halves.abs().argmax(-1, keepdim=True)).squeeze(-1)
    scale = extreme / -float(offset)  # [N, K/16]
    d = _group_d(scale)
    codes = _round_codes(halves, scale, d, -offset, offset - 1)
    return codes.view(rows, cols), d, _sub_scales(scale, d)


def _group_d(scale: torch.Tensor) -> torch.Tensor:
    """[N, K/16] scales -> d [N, K/32]: the pair's largest |scale| / 127, fp16-representable."""
    return (scale.abs().view(scale.shape[0], -1, 2).amax(-1) / 127.0).half().float()


def _sub_scales(scale: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    d_half = d.repeat_interleave(2, dim=1)
    inv_d = torch.where(d_half > 0, 1.0 / d_half, torch.zeros_like(d_half))
    return torch.round(scale * inv_d).clamp(-128, 127).to(torch.int8)


def _round_codes(
    halves: torch.Tensor, scale: torch.Tensor, d: torch.Tensor, low: int, high: int
) -> torch.Tensor:
    """[N, K/16, 16] values -> int8 codes in low..high on each 16's step d sc."""
    step = (_sub_scales(scale, d).float() * d.repeat_interleave(2, dim=1))[..., None]
    inv = torch.where(step != 0, 1.0 / step, torch.zeros_like(step))
    return torch.round(halves * inv).clamp(low, high).to(torch.int8)


def quantize_w6m(
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dense [N, K] weight -> W6M codes, d, sc and m: m is each group's midpoint (fp16), the
    rest quantize_w6 of the weight less m (loaders make W6M from GGUF blocks; this is for
    dense checkpoints and tests)."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // GROUP, GROUP)
    m = ((groups.amax(-1) + groups.amin(-1)) / 2).half().float()  # [N, K/32]
    centred = weight.float() - expand_groups(m, GROUP, cols)
    return (*quantize_w6(centred), m)


def quantize_w5m(
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dense [N, K] weight -> W5M codes (0..31), d, sc and m as Q5_1 / Q5_K make them: m is
    each group's minimum (fp16), each 16's largest value less m becomes code 31 (for tests and
    dense checkpoints; loaders make W5M from GGUF blocks)."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // GROUP, GROUP)
    m = groups.amin(-1).half().float()  # [N, K/32]
    centred = (weight.float() - expand_groups(m, GROUP, cols)).view(rows, cols // HALF, HALF)
    scale = centred.amax(-1) / 31.0  # [N, K/16], >= 0 up to m's rounding
    d = _group_d(scale)
    codes = _round_codes(centred, scale, d, 0, 31)
    return codes.view(rows, cols), d, _sub_scales(scale, d), m


# ---- the C++ kernels ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PackedWeight:
    """A weight in the kernels' block layout, for one code path (the W8 layout depends on it)."""

    blocks: torch.Tensor  # uint8, flat
    out_features: int
    in_features: int
    bits: int  # 4 (w4a8), 5 (w5a8), W5_MIN (w5ma8), 6 (w6a8), W6_MIN (w6ma8), 8 (w8a8) or
    # W8_FLOAT (w8: float x)
    isa: str


def pack_w4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, isa: str) -> PackedWeight:
    ext = _ext()
    blocks = ext.pack_w4(codes.to(torch.uint8).contiguous(), d.float(), m.float())
    return PackedWeight(blocks, codes.shape[0], codes.shape[1], 4, isa)


def pack_w8(codes: torch.Tensor, d: torch.Tensor, isa: str) -> PackedWeight:
    blocks = _ext().pack_w8(codes.to(torch.int8).contiguous(), d.float(), isa)
    return PackedWeight(blocks, codes.shape[0], codes.shape[1], 8, isa)


def pack_w6(codes: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, isa: str) -> PackedWeight:
    """codes [N, K] int8 in -32..31, d [N, K/32], sc [N, K/16] int8 (the layout is the same for
    both code paths; `isa` says which the weight runs on)."""
    ext = _ext()
    blocks = ext.pack_w6(
        codes.to(torch.int8).contiguous(), d.float(), sc.to(torch.int8).contiguous()
    )
    return PackedWeight(blocks, codes.shape[0], codes.shape[1], 6, isa)


def pack_w6m(
    codes: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, isa: str
) -> PackedWeight:
    """pack_w6's blocks with m [N, K/32] (fp16) after each: the W6M layout (csrc/qgemm.cpp)."""
    blocks = _ext().pack_w6m(
        codes.to(torch.int8).contiguous(), d.float(), sc.to(torch.int8).contiguous(), m.float()
    )
    return PackedWeight(blocks, codes.shape[0], codes.shape[1], W6_MIN, isa)


def pack_w5(codes: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, isa: str) -> PackedWeight:
    """codes [N, K] int8 in -16..15, d [N, K/32], sc [N, K/16] int8: the W5 layout."""
    blocks = _ext().pack_w5(
        codes.to(torch.int8).contiguous(), d.float(), sc.to(torch.int8).contiguous()
    )
    return PackedWeight(blocks, codes.shape[0], codes.shape[1], 5, isa)


def pack_w5m(
    codes: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, isa: str
) -> PackedWeight:
    """codes [N, K] int8 in 0..31 (unshifted: W5M's codes are unsigned), d and m [N, K/32], sc
    [N, K/16] int8: the W5M layout."""
    blocks = _ext().pack_w5m(
        codes.to(torch.int8).contiguous(), d.float(), sc.to(torch.int8).contiguous(), m.float()
    )
    return PackedWeight(blocks, codes.shape[0], codes.shape[1], W5_MIN, isa)


def pack_w8_float(codes: torch.Tensor, d: torch.Tensor, isa: str) -> PackedWeight:
    """W8 codes for the weight-only kernel (float activations, csrc/w8float.cpp)."""
    blocks = _ext().pack_w8float(codes.to(torch.int8).contiguous(), d.float())
    return PackedWeight(blocks, codes.shape[0], codes.shape[1], W8_FLOAT, isa)


def pack_mxfp4(
    qweight: torch.Tensor, scales: torch.Tensor, isa: str, int8_activations: bool = True
) -> PackedWeight:
    """qweight [N, K/2] uint8 e2m1 codes (column 2j low), scales [N, K/32] E8M0 -> the MXFP4
    panel layout (csrc/fp4gemm.cpp), the same for both code paths and for both kernels (int8
    activations, or float32 ones: weight-only)."""
    empty = torch.empty(0, dtype=torch.float32)
    blocks = _ext().pack_fp4(_bytes(qweight), _bytes(scales), empty, MXFP4A8)
    bits = MXFP4A8 if int8_activations else MXFP4
    return PackedWeight(blocks, qweight.shape[0], 2 * qweight.shape[1], bits, isa)


def pack_nvfp4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    tensor_scale: torch.Tensor,
    isa: str,
    int8_activations: bool = True,
) -> PackedWeight:
    """qweight [N, K/2], scales [N, K/16] e4m3 bits, tensor_scale [N] float32 (one per row)
    -> the NVFP4 panel layout, the tensor scales after the blocks."""
    rows = qweight.shape[0]
    t = tensor_scale.float().reshape(-1).expand(rows).contiguous()
    blocks = _ext().pack_fp4(_bytes(qweight), _bytes(scales), t, NVFP4A8)
    bits = NVFP4A8 if int8_activations else NVFP4
    return PackedWeight(blocks, rows, 2 * qweight.shape[1], bits, isa)


def pack_mxfp4_float(qweight: torch.Tensor, scales: torch.Tensor, isa: str) -> PackedWeight:
    return pack_mxfp4(qweight, scales, isa, int8_activations=False)


def pack_nvfp4_float(
    qweight: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor, isa: str
) -> PackedWeight:
    return pack_nvfp4(qweight, scales, tensor_scale, isa, int8_activations=False)


def mxfp4_float_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """The weight-only MXFP4 product in float64: x times the stored weights."""
    return (x.double() @ fp4.dequantize_mxfp4(qweight, scales).double().T).float()


def nvfp4_float_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor
) -> torch.Tensor:
    """The weight-only NVFP4 product in float64 (block scale times tensor scale unrounded)."""
    values = fp4.e2m1_to_float(fp4.unpack_fp4(qweight)).double()
    block = fp4.expand(fp4.e4m3_to_float(scales).double(), fp4.NVFP4_GROUP)
    weight = values * block * tensor_scale.double()[:, None]
    return (x.double() @ weight.T).float()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 (or e4m3) tensor as contiguous uint8 bytes."""
    return tensor.contiguous().view(torch.uint8)


def quantized_linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """[M, K] float32 -> [M, N] float32 through the C++ kernel of the weight's code path."""
    ext = _ext()
    run = {
        4: ext.w4a8_linear,
        5: ext.w5a8_linear,
        W5_MIN: ext.w5ma8_linear,
        6: ext.w6a8_linear,
        W6_MIN: ext.w6ma8_linear,
        8: ext.w8a8_linear,
        W8_FLOAT: ext.w8float_linear,
        MXFP4A8: lambda x, b, n, isa: ext.fp4a8_linear(x, b, n, MXFP4A8, isa),
        NVFP4A8: lambda x, b, n, isa: ext.fp4a8_linear(x, b, n, NVFP4A8, isa),
        MXFP4: lambda x, b, n, isa: ext.fp4float_linear(x, b, n, MXFP4, isa),
        NVFP4: lambda x, b, n, isa: ext.fp4float_linear(x, b, n, NVFP4, isa),
    }[weight.bits]
    return run(x.float().contiguous(), weight.blocks, weight.out_features, weight.isa)


def w8_float_reference(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The weight-only W8 product in float64: x times the stored weights, no activation rounding."""
    return (x.double() @ dequantize_w8(codes, d).double().T).float()


def _ext() -> Any:
    module = native.load()
    if module is None:
        raise RuntimeError("densa's C++ kernels are not built (see densa.kernels.cpu.native)")
    return module
