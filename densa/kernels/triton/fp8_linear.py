"""FP8 (e4m3) block-scaled weights times 16-bit activations on the GPU (Triton): W8A16,
y = x @ (weight * scale)^T, with the runtime layout of `densa.kernels.cpu.fp8_linear`
(weight [N, K] float8_e4m3fn, scale [N, ceil(K / B)] float32: block scales repeated per row).

Same tiling as the INT4 kernel (`triton_int4`): a BLOCK_M x BLOCK_N output tile per program,
split-K for few rows, and, since a K step of BLOCK_K columns lies inside one scale block
(BLOCK_K divides B), the scale multiplies the [BLOCK_M, BLOCK_N] product instead of every
weight. e4m3 values are exact in fp16 and bf16, so the widened weights go to the tensor cores
unchanged; one byte per weight is read.

Why not torch._scaled_mm: it wants FP8 activations too (quantizing x per step, and per-token
activation scales), and block-wise scaling support varies across torch releases; a decode step
is bound by reading the weight, which this kernel already reads as one byte.
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

if triton is not None:
    import triton.language as tl

    from densa.kernels.triton.common import mma

    @triton.jit
    def _fp8_matmul_kernel(
        x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
        M, N, K, k_per_split,
        stride_xm, stride_wn, stride_sn, stride_om, stride_os,
        SCALE_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PARTIALS: tl.constexpr, WIDEN: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
        w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
        s_rows = scale_ptr + cols.to(tl.int64) * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            part = mma(x, tl.trans(w.to(x.dtype)), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), WIDEN)
            scale = tl.load(s_rows + k0 // SCALE_BLOCK, mask=col_ok, other=0.0)
            acc += part * scale[None, :]
        out = out_ptr + pid_k * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        if not PARTIALS:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out, acc, mask=mask)


def candidate_configs(
    num_rows: int, out_features: int, in_features: int, scale_block: int, device: torch.device
) -> list[LaunchConfig]:
    block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64
    block_k = math.gcd(scale_block, 128)
    sms = multiprocessors(device)
    configs = []
    for block_n in (64, 128):
        tiles = math.ceil(num_rows / block_m) * math.ceil(out_features / block_n)
        max_split = max(1, in_features // (2 * block_k))
        split = max(1, min(max_split, math.ceil(2 * sms / tiles), 16))
        for split_k in sorted({split, max(1, split // 2)}, key=lambda s: s != split):
            for num_warps in (4, 8):
                configs.append(LaunchConfig(block_m, block_n, block_k, split_k, num_warps, 3))
    return configs


def fp8_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: int,
    bias: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """[M, K] x fp8 [N, K] (row scales [N, ceil(K/block)]) -> [M, N] in x's dtype."""
    require_triton()
    x = x.contiguous()
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    if config is None:
        key = ("fp8", m_bucket(num_rows), out_features, in_features, block, x.dtype)
        candidates = candidate_configs(num_rows, out_features, in_features, block, x.device)
        config = best(
            key,
            candidates,
            lambda c: fp8_linear_triton(x, weight, scale, block, bias, c),
            x.device,
        )
    if block % config.block_k:
        raise ValueError(f"block_k {config.block_k} must divide the scale block {block}")
    k_per_split, split_k = split_ranges(in_features, config)
    out = torch.empty(
        (split_k, num_rows, out_features),
        dtype=torch.float32 if split_k > 1 else x.dtype,
        device=x.device,
    )
    grid = (
        triton.cdiv(num_rows, config.block_m),
        triton.cdiv(out_features, config.block_n),
        split_k,
    )
    _fp8_matmul_kernel[grid](
        x, weight, scale, or_dummy(bias, scale), out,
        num_rows, out_features, in_features, k_per_split,
        x.stride(0), weight.stride(0), scale.stride(0), out.stride(1), out.stride(0),
        SCALE_BLOCK=block, HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        PARTIALS=split_k > 1, WIDEN=interpreting(),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if split_k == 1:
        return out[0]
    result = out.sum(dim=0)
    if bias is not None:
        result += bias.float()
    return result.to(x.dtype)
