"""Small-batch fp32 matmul for CPU decode: y = x @ W^T with W in its natural [out, in] layout.

At decode time a step multiplies a few activation rows by every weight matrix, so the cost is
streaming the weights from memory. torch's CPU GEMM reaches ~10 GB/s on this shape (measured on a
2-core AVX-512 EPYC: 30 x [3072 x 576] at M=1 in 20 ms); a kernel that walks the weight rows once,
in parallel, and dots each row (still in L1) with the M activation rows reaches ~27-34 GB/s
(8 ms). Beyond M ~ 8 the work becomes compute-bound and torch's blocked GEMM wins again, so
`linear` only takes this path for small M.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit, prange

from densa.kernels import numba_threads  # noqa: F401  (must run before any parallel kernel)

# Largest M for which the streaming kernel beat torch's GEMM in the measurements above.
MAX_STREAMING_ROWS = 8
_ROWS_PER_TASK = 16  # weight rows per parallel task: big enough to amortize scheduling


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _streaming_matmul(weight: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    num_out, num_in = weight.shape
    num_rows = x.shape[0]
    num_tasks = (num_out + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK
    for task in prange(num_tasks):
        for r in range(task * _ROWS_PER_TASK, min(num_out, (task + 1) * _ROWS_PER_TASK)):
            for i in range(num_rows):
                acc = np.float32(0.0)
                for j in range(num_in):
                    acc += weight[r, j] * x[i, j]
                out[i, r] = acc


def can_stream(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[0] <= MAX_STREAMING_ROWS
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.is_contiguous()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear semantics ([M, in] x [out, in] -> [M, out]); streams the weights when M is small."""
    if not can_stream(x, weight):
        return F.linear(x, weight, bias)
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    _streaming_matmul(weight.detach().numpy(), x.detach().numpy(), out.numpy())
    return out if bias is None else out + bias
