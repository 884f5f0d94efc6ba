"""W4A16 group-wise INT4 matmul on the GPU (Triton): y = x @ dequant(W)^T for M = 1..64 rows
(decode) and beyond, with the row-major layout of `densa.kernels.cpu.int4_linear` (tested against
its `int4_linear_ref`).

Each program computes a BLOCK_M x BLOCK_N tile of y over its share of K (split-K: split_k
programs per tile, partial sums added after, so a GEMV over few output features still fills
the GPU). Per step it loads BLOCK_K/2 bytes of each of its weight rows once, and takes the two
nibbles of each byte as two tiles, matched with the even and odd columns of x:

    lo, hi     [BLOCK_N, BLOCK_K/2]   codes 0..15 of columns 2j and 2j+1
    partial    = x_even @ (lo - 8)^T + x_odd @ (hi - 8)^T        exact small integers, fp32 sum
    acc       += partial * scale[n, group] (+ rowsum(x) * zero[n, group])

When a K step lies inside one scale group (BLOCK_K divides the group size) the scale multiplies
the [BLOCK_M, BLOCK_N] result, not every weight: w = (q - 8) * s + z factors out of the dot.
Otherwise (groups smaller than the step) each weight is scaled before the product.

Codes become 16-bit floats by the magic-number trick on a GPU: the bits 0x4300 | q are the
bfloat16 128 + q (0x6400 | q the float16 1024 + q), so one OR and one subtraction replace an
integer-to-float conversion, which runs at a quarter of the ALU rate on Hopper and would cap a
GEMV near half the memory bandwidth. The interpreter cannot do bfloat16 arithmetic, so there
(and for float32 activations) codes are converted plainly; the float16 trick is tested there,
the bfloat16 one only by the GPU check (scripts/gpu_check.sh).
"""

from __future__ import annotations

import math

import torch

from densa.kernels.triton.common import (
    interpreting,
    multiprocessors,
    or_dummy,
    require_triton,
    triton,
)
from densa.kernels.triton.tuning import LaunchConfig, best, m_bucket, split_ranges

DEQUANT_PLAIN, DEQUANT_BF16_MAGIC, DEQUANT_FP16_MAGIC = 0, 1, 2

if triton is not None:
    import triton.language as tl

    from densa.kernels.triton.common import mma

    @triton.jit
    def _centred(codes, DEQUANT: tl.constexpr, DTYPE: tl.constexpr):
        """int32 codes 0..15 -> code - 8 in DTYPE (exact)."""
        if DEQUANT == 1:
            magic = (codes | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
            return (magic - 136.0).to(DTYPE)
        if DEQUANT == 2:
            magic = (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
            return (magic - 1032.0).to(DTYPE)
        return (codes - 8).to(DTYPE)

    @triton.jit
    def _int4_matmul_kernel(
        x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
        M, N, K, k_per_split,
        stride_xm, stride_qn, stride_sn, stride_om, stride_os,
        GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PARTIALS: tl.constexpr, DEQUANT: tl.constexpr, WIDEN: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows of x / y
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
        row_ok, col_ok = rows < M, cols < N
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
        w_rows = qweight_ptr + cols[:, None].to(tl.int64) * stride_qn
        s_rows = scales_ptr + cols.to(tl.int64) * stride_sn
        z_rows = zeros_ptr + cols.to(tl.int64) * stride_sn
        byte_idx = tl.arange(0, BLOCK_K // 2)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            byte = k0 // 2 + byte_idx  # [BK/2] packed byte columns
            even, odd = 2 * byte, 2 * byte + 1
            x_even = tl.load(
                x_rows + even[None, :], mask=row_ok[:, None] & (even < K)[None, :], other=0.0
            )
            x_odd = tl.load(
                x_rows + odd[None, :], mask=row_ok[:, None] & (odd < K)[None, :], other=0.0
            )
            packed = tl.load(
                w_rows + byte[None, :], mask=col_ok[:, None] & (even < K)[None, :], other=0
            ).to(tl.int32)  # [BN, BK/2]
            lo = _centred(packed & 0xF, DEQUANT, x_ptr.dtype.element_ty)
            hi = _centred(packed >> 4, DEQUANT, x_ptr.dtype.element_ty)
            if GROUP_SIZE % BLOCK_K == 0:  # the whole step is in one group: scale the result
                group = k0 // GROUP_SIZE
                part = mma(x_even, tl.trans(lo), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), WIDEN)
                part = mma(x_odd, tl.trans(hi), part, WIDEN)
                scale = tl.load(s_rows + group, mask=col_ok, other=0.0).to(tl.float32)
                acc += part * scale[None, :]
                if HAS_ZEROS:
                    zero = tl.load(z_rows + group, mask=col_ok, other=0.0).to(tl.float32)
                    x_sum = tl.sum(x_even.to(tl.float32), axis=1) + tl.sum(
                        x_odd.to(tl.float32), axis=1
                    )
                    acc += x_sum[:, None] * zero[None, :]
            else:  # several groups per step: scale each weight
                g_even, g_odd = even // GROUP_SIZE, odd // GROUP_SIZE
                mask = col_ok[:, None] & (even < K)[None, :]
                s_even = tl.load(s_rows[:, None] + g_even[None, :], mask=mask, other=0.0).to(
                    tl.float32
                )
                s_odd = tl.load(s_rows[:, None] + g_odd[None, :], mask=mask, other=0.0).to(
                    tl.float32
                )
                w_lo = lo.to(tl.float32) * s_even
                w_hi = hi.to(tl.float32) * s_odd
                if HAS_ZEROS:
                    w_lo += tl.load(z_rows[:, None] + g_even[None, :], mask=mask, other=0.0).to(
                        tl.float32
                    )
                    w_hi += tl.load(z_rows[:, None] + g_odd[None, :], mask=mask, other=0.0).to(
                        tl.float32
                    )
                dtype = x_ptr.dtype.element_ty
                acc = mma(x_even, tl.trans(w_lo.to(dtype)), acc, WIDEN)
                acc = mma(x_odd, tl.trans(w_hi.to(dtype)), acc, WIDEN)
        out = out_ptr + pid_k * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        if not PARTIALS:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out, acc, mask=mask)  # float32 partials, summed by the caller


def dequant_mode(dtype: torch.dtype) -> int:
    if dtype == torch.float16:
        return DEQUANT_FP16_MAGIC
    if dtype == torch.bfloat16 and not interpreting():
        return DEQUANT_BF16_MAGIC
    return DEQUANT_PLAIN


def candidate_configs(
    num_rows: int, out_features: int, in_features: int, group_size: int, device: torch.device
) -> list[LaunchConfig]:
    """Configs worth timing for this shape, the heuristic's choice first."""
    block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64
    # K steps of 128 columns (64 bytes per weight row) when the group allows scaling the result.
    block_k = 128 if group_size % 128 == 0 else group_size if group_size in (32, 64) else 64
    sms = multiprocessors(device)
    configs = []
    for block_n in (64, 128):
        tile = (block_m, block_n, block_k)
        for split_k in _split_choices(num_rows, out_features, in_features, tile, sms):
            for num_warps in (4, 8):
                configs.append(LaunchConfig(block_m, block_n, block_k, split_k, num_warps, 3))
    return configs


def _split_choices(
    num_rows: int, out_features: int, in_features: int, tile: tuple[int, int, int], sms: int
) -> list[int]:
    """The heuristic split first: enough programs for ~2 per multiprocessor, none idle."""
    block_m, block_n, block_k = tile
    tiles = math.ceil(num_rows / block_m) * math.ceil(out_features / block_n)
    max_split = max(1, in_features // (2 * block_k))
    wanted = max(1, min(max_split, math.ceil(2 * sms / tiles), 16))
    return sorted({wanted, max(1, wanted // 2)}, key=lambda split: split != wanted)


def int4_linear_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """[M, K] x int4 [N, K] -> [M, N] in x's dtype. `config` None: the tuner's pick."""
    require_triton()
    x = x.contiguous()
    num_rows, in_features = x.shape
    out_features = qweight.shape[0]
    if config is None:
        key = ("int4", m_bucket(num_rows), out_features, in_features, group_size, x.dtype)
        candidates = candidate_configs(num_rows, out_features, in_features, group_size, x.device)
        config = best(
            key,
            candidates,
            lambda c: int4_linear_triton(x, qweight, scales, zeros, group_size, bias, c),
            x.device,
        )
    k_per_split, split_k = split_ranges(in_features, config)
    # [splits, M, N]: float32 partials when split, else the result itself (one "split").
    out_dtype = torch.float32 if split_k > 1 else x.dtype
    out = torch.empty(split_k, num_rows, out_features, dtype=out_dtype, device=x.device)
    grid = (
        triton.cdiv(num_rows, config.block_m),
        triton.cdiv(out_features, config.block_n),
        split_k,
    )
    _int4_matmul_kernel[grid](
        x, qweight, scales, or_dummy(zeros, scales), or_dummy(bias, scales), out,
        num_rows, out_features, in_features, k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(1), out.stride(0),
        GROUP_SIZE=group_size, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        PARTIALS=split_k > 1, DEQUANT=dequant_mode(x.dtype), WIDEN=interpreting(),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if split_k == 1:
        return out[0]
    result = out.sum(dim=0)
    if bias is not None:
        result += bias.float()
    return result.to(x.dtype)


def is_available() -> bool:
    return triton is not None
