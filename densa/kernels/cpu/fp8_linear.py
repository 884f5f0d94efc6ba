"""FP8 (e4m3) weight-only linear layers on CPU: a torch reference and a streaming kernel, over
the runtime layout of densa.formats.fp8_blocks (real w[n, k] = weight[n, k] * scale[n, k // B]).

CPU notes: this CPU has no fp8 arithmetic. float32 rows stream the fp8 bytes through a Numba
kernel that widens each byte by moving its bit fields into an fp32 pattern (1 byte read per
weight instead of 4), once per call, and dots every row in the same order whatever M (as
cpu_linear; torch's GEMM, used before for more than 8 rows, rounds a row differently at
different M); other dtypes beyond 8 rows dequantize the weight once per call and run torch's
GEMM. Measured on the 2-core dev machine (noisy), 3072 x 576 at M = 1: ~0.6 ms vs ~0.25 ms for
the fp32 streaming kernel -- the widening costs more than the bandwidth saves, so on this CPU
FP8 weights save memory, not time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from densa.formats.fp8_blocks import dequantize_fp8

MAX_STREAMING_ROWS = 8  # other dtypes than float32: beyond this the GEMM path is compute-bound


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slow, obviously correct: the plain fp8 cast, then a float32 matmul."""
    in_features = weight.shape[1]
    dense = weight.float() * scale.float().repeat_interleave(block, dim=1)[:, :in_features]
    out = F.linear(x.float(), dense, None if bias is None else bias.float())
    return out.to(x.dtype)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[M, K] x fp8 [N, K] -> [M, N] in x's dtype: streamed for float32 CPU rows (any M: a row's
    result never depends on the others: docs/architecture.md) and small batches of others."""
    small = x.dtype == torch.float32 or x.shape[0] <= MAX_STREAMING_ROWS
    if x.device.type != "cpu" or x.dim() != 2 or not small:
        dense = dequantize_fp8(weight, scale, block).to(x.dtype)
        return F.linear(x, dense, bias)
    from densa.kernels.cpu import streaming_matmul as kernels  # imports Numba: on the first call

    rows = x.float().contiguous()
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
    kernels.streaming_fp8_matmul(
        weight.view(torch.uint8).numpy(), scale.float().numpy(), block, rows.numpy(), out.numpy()
    )
    out = out.to(x.dtype)
    return out if bias is None else out + bias
