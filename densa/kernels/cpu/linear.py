"""fp32 matmul for CPU steps: y = x @ W^T with W in its natural [out, in] layout, the same
arithmetic for a row whatever the number of rows (docs/architecture.md, "Batch invariance").

At decode time a step multiplies a few activation rows by every weight matrix, so the cost is
streaming the weights from memory. torch's CPU GEMM reaches ~10 GB/s on this shape (measured on a
2-core AVX-512 EPYC: 30 x [3072 x 576] at M=1 in 20 ms); a kernel that walks the weight rows once,
in parallel, and dots each row (still in L1) with the M activation rows reaches ~27-34 GB/s
(8 ms). Larger M walks the rows in blocks of _TOKEN_BLOCK tokens (kept in L1/L2 while a task's
weight rows pass them); every output is still one dot product in the same order.

Why not torch's GEMM beyond a few rows (as before): it rounds a row differently at different M
(a single row is a GEMV; tails of 1-3 rows take other micro-kernels), so a request's logits
depended on how many others sampled in the same step. Measured single-threaded on the same
(loaded) machine, the dot-product kernel is within noise of it at M <= 32 on the 49152 x 576
head and 3072 x 576, and up to ~1.5x slower at M = 512; in the default path only the output
head (the rows that sample) runs here -- the decoder's own projections are in C++.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def can_stream(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.is_contiguous()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear semantics ([M, in] x [out, in] -> [M, out]); fp32 CPU rows by the dot-product
    kernel, anything else by torch."""
    if not can_stream(x, weight):
        return F.linear(x, weight, bias)
    from densa.kernels.cpu import streaming_matmul as kernels  # imports Numba: on the first call

    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    kernels.streaming_matmul(weight.detach().numpy(), x.detach().numpy(), out.numpy())
    return out if bias is None else out + bias
