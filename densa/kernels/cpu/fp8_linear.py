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

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit, prange

from densa.formats.fp8_blocks import dequantize_fp8
from densa.kernels.cpu import numba_threads  # noqa: F401  (must run before any parallel kernel)

MAX_STREAMING_ROWS = 8  # other dtypes than float32: beyond this the GEMM path is compute-bound
_ROWS_PER_TASK = 16
_TOKEN_BLOCK = 16  # activation rows a task's weight rows pass at a time (as cpu_linear)
# The e4m3 fields placed at the top of an fp32 bit pattern give value * 2**-120 (subnormals
# included: both formats' subnormals scale the same way); the factor goes into the block scale.
_FP32_BITS_SCALE = np.float32(2.0**120)


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


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _streaming_fp8_matmul(
    weight: np.ndarray, scale: np.ndarray, block: int, x: np.ndarray, out: np.ndarray
) -> None:
    num_out, num_in = weight.shape
    num_rows = x.shape[0]
    num_tasks = (num_out + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK
    for task in prange(num_tasks):
        first = task * _ROWS_PER_TASK
        count = min(num_out, first + _ROWS_PER_TASK) - first
        # The task's weight rows, widened and scaled once, then reused from L1/L2 by every token.
        bits = np.empty((count, num_in), dtype=np.uint32)
        rows = bits.view(np.float32)
        for r in range(count):
            for j in range(num_in):
                byte = np.uint32(weight[first + r, j])
                bits[r, j] = ((byte & 0x80) << 24) | ((byte & 0x7F) << 20)
            for b in range(scale.shape[1]):
                factor = scale[first + r, b] * _FP32_BITS_SCALE
                for j in range(b * block, min(num_in, (b + 1) * block)):
                    rows[r, j] *= factor
        for t0 in range(0, num_rows, _TOKEN_BLOCK):
            for r in range(count):
                for i in range(t0, min(num_rows, t0 + _TOKEN_BLOCK)):
                    # The one loop every output runs: same order for any M (batch invariance).
                    acc = np.float32(0.0)
                    for j in range(num_in):
                        acc += rows[r, j] * x[i, j]
                    out[i, first + r] = acc


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
    rows = x.float().contiguous()
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
    _streaming_fp8_matmul(
        weight.view(torch.uint8).numpy(), scale.float().numpy(), block, rows.numpy(), out.numpy()
    )
    out = out.to(x.dtype)
    return out if bias is None else out + bias
