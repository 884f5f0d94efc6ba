"""FP4 weights (MXFP4, NVFP4) times 16/32-bit activations on the GPU (Triton): y = x @ W^T with W
in the row-major layout of densa.formats.fp4 (qweight [N, K/2], scale bytes per group, NVFP4's
tensor scale per row), dequantized in registers, tested against densa.formats.fp4's reference
dequantization in Triton's CPU interpreter (untested on a GPU here).

Each program computes a BLOCK_M x BLOCK_N tile of y in steps of 32 inputs (16 bytes per weight
row: one MXFP4 group, two NVFP4 groups). A byte's two codes are columns 2j and 2j + 1, matched
with x's even and odd columns (as the INT4 kernel does); an e2m1 code c becomes 2v, an integer
in -12..12 (exact in 16-bit floats), from its bits:

    |c| < 2: 2v = |c|          else: 2v = (2 + (|c| & 1)) << ((|c| >> 1) - 1)      sign: c & 8

    MXFP4   acc += (x_even @ lo^T + x_odd @ hi^T) * 2^(s - 128)     the group's scale factors
            out of the step's dot (s: E8M0, 0xFF NaN, 0x00 the subnormal 2^-127)
    NVFP4   each weight times its group's e4m3 scale / 2 before the dot; y *= t[n] at the end

Scales are decoded from their bits (never exp2, which may flush subnormals on a GPU).
"""

from __future__ import annotations

import torch

from densa.formats.fp4 import Fp4Scheme
from densa.kernels.triton.common import interpreting, or_dummy, require_triton, triton

BLOCK_K = 32  # inputs per step

if triton is not None:
    import triton.language as tl

    from densa.kernels.triton.common import mma

    @triton.jit
    def _two_v(codes):
        """int32 e2m1 codes -> 2 * value as float32 (exact integers in -12..12)."""
        mag = codes & 7
        shift = tl.maximum((mag >> 1) - 1, 0)
        two_v = tl.where(mag < 2, mag, (2 + (mag & 1)) << shift)
        return tl.where((codes & 8) != 0, -two_v, two_v).to(tl.float32)

    @triton.jit
    def _e8m0(s):
        """int32 E8M0 bytes -> float32 2^(s - 127); 0 is 2^-127, 255 NaN."""
        bits = tl.where(s == 0, 0x00400000, s << 23)
        bits = tl.where(s == 255, 0x7FC00000, bits)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _e4m3(b):
        """int32 e4m3 bytes -> float32, from the bit fields; S.1111.111 is NaN."""
        exponent, mantissa = (b >> 3) & 15, b & 7
        normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
        value = tl.where((b & 0x80) != 0, -value, value)
        nan = (0x7FC00000 + 0 * b).to(tl.float32, bitcast=True)
        return tl.where((b & 0x7F) == 0x7F, nan, value)

    @triton.jit
    def _fp4_matmul_kernel(
        x_ptr, qweight_ptr, scales_ptr, tscale_ptr, bias_ptr, out_ptr,
        M, N, K, stride_xm, stride_qn, stride_sn, stride_om,
        NVFP4: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDEN: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
        w_rows = qweight_ptr + cols[:, None].to(tl.int64) * stride_qn
        s_rows = scales_ptr + cols.to(tl.int64) * stride_sn
        byte_idx = tl.arange(0, BLOCK_K // 2)  # [16]
        dtype = x_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            byte = k0 // 2 + byte_idx
            even, odd = 2 * byte, 2 * byte + 1
            x_even = tl.load(x_rows + even[None, :], mask=row_ok[:, None], other=0.0)
            x_odd = tl.load(x_rows + odd[None, :], mask=row_ok[:, None], other=0.0)
            packed = tl.load(w_rows + byte[None, :], mask=col_ok[:, None], other=0).to(tl.int32)
            lo, hi = _two_v(packed & 0xF), _two_v(packed >> 4)  # [BN, 16] each
            if NVFP4:  # two groups of 16 per step: scale each weight by its group's
                group = (k0 // 16) + byte_idx // 8  # a byte's two codes share a group
                sbytes = tl.load(s_rows[:, None] + group[None, :], mask=col_ok[:, None], other=0)
                scale = _e4m3(sbytes.to(tl.int32)) * 0.5
                acc = mma(x_even, tl.trans((lo * scale).to(dtype)), acc, WIDEN)
                acc = mma(x_odd, tl.trans((hi * scale).to(dtype)), acc, WIDEN)
            else:  # one group per step: its scale multiplies the step's product
                part = mma(x_even, tl.trans(lo.to(dtype)), tl.zeros_like(acc), WIDEN)
                part = mma(x_odd, tl.trans(hi.to(dtype)), part, WIDEN)
                s = tl.load(s_rows + k0 // 32, mask=col_ok, other=127).to(tl.int32)
                acc += part * (_e8m0(s) * 0.5)[None, :]
        if NVFP4:
            acc *= tl.load(tscale_ptr + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fp4_linear_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    tensor_scale: torch.Tensor | None,
    scheme: Fp4Scheme,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[M, K] x FP4 [N, K] -> [M, N] in x's dtype (K a multiple of 32)."""
    require_triton()
    x = x.contiguous()
    num_rows, in_features = x.shape
    out_features = qweight.shape[0]
    if in_features % BLOCK_K:
        raise ValueError(f"the FP4 Triton kernel needs K % {BLOCK_K} == 0, not {in_features}")
    nvfp4 = scheme == Fp4Scheme.NVFP4  # the kernel has two paths: MXFP4 and NVFP4
    scales = scales.contiguous().view(torch.uint8)
    t = tensor_scale.float().contiguous() if tensor_scale is not None else None
    block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64
    block_n = 64
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(out_features, block_n))
    _fp4_matmul_kernel[grid](
        x, qweight, scales, or_dummy(t, scales), or_dummy(bias, scales), out,
        num_rows, out_features, in_features, x.stride(0), qweight.stride(0), scales.stride(0),
        out.stride(0), NVFP4=nvfp4, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, WIDEN=interpreting(),
    )  # fmt: skip
    return out


def is_available() -> bool:
    return triton is not None
