"""INT4 weight-only matmul for GPUs, in Triton: y = x @ dequant(W)^T, with the row-major layout
of `densa.kernels.int4_linear` (validated against its `int4_linear_ref`).

Each program computes a BLOCK_M x BLOCK_N tile of y, walking K in BLOCK_K steps: it loads the
packed bytes of its weight rows, picks each column's nibble, applies the column's group scale
(and zero) and accumulates x_tile @ w_tile^T in fp32. The weight is read once per M tile, as 4
bits, which is what makes decode (small M) faster than a 16-bit weight.

Status: tested only on CPU, through Triton's interpreter (TRITON_INTERPRET=1); not yet run or
tuned on a GPU. The block sizes are untuned starting points.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: CPU-only installs never reach this path
    triton = None


def is_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _int4_matmul_kernel(
        x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
        M, N, K,
        stride_xm, stride_qn, stride_sn, stride_om,
        GROUP_SIZE: tl.constexpr,
        HAS_ZEROS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows of x / y
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
        row_ok = rows[:, None] < M
        col_ok = cols[:, None] < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_start in range(0, K, BLOCK_K):
            ks = k_start + tl.arange(0, BLOCK_K)  # [BK] input features
            k_ok = ks[None, :] < K
            x = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok & k_ok, other=0.0
            )
            packed = tl.load(
                qweight_ptr + cols[:, None] * stride_qn + ks[None, :] // 2,
                mask=col_ok & k_ok,
                other=0,
            )  # [BN, BK]: each byte is loaded for both of its columns
            codes = (packed >> ((ks[None, :] % 2) * 4)) & 0xF
            group_idx = cols[:, None] * stride_sn + ks[None, :] // GROUP_SIZE
            scale = tl.load(scales_ptr + group_idx, mask=col_ok & k_ok, other=0.0).to(tl.float32)
            weight = (codes.to(tl.float32) - 8.0) * scale
            if HAS_ZEROS:
                weight += tl.load(zeros_ptr + group_idx, mask=col_ok & k_ok, other=0.0).to(
                    tl.float32
                )
            acc += tl.dot(x, tl.trans(weight.to(x.dtype)), input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows[:, None] * stride_om + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok & (cols[None, :] < N))


def int4_linear_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    block_m: int = 16,
    block_n: int = 32,
    block_k: int = 32,
) -> torch.Tensor:
    """[M, K] x int4 [N, K] -> [M, N] in x's dtype."""
    if triton is None:
        raise RuntimeError("the Triton int4 kernel needs `pip install triton`")
    x = x.contiguous()
    num_rows, in_features = x.shape
    out_features = qweight.shape[0]
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(out_features, block_n))
    _int4_matmul_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else scales,
        bias if bias is not None else scales, out,
        num_rows, out_features, in_features,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        GROUP_SIZE=group_size, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out
