"""Linear layers. The dense layer is also the seam where quantized weight formats plug in."""

from __future__ import annotations

import torch
from torch import nn

from densa.kernels import cpu_linear


class Linear(nn.Module):
    """y = x W^T (+ b) with W stored [out_features, in_features], like nn.Linear.

    Small CPU batches (decode) stream the weights through a fused kernel; everything else uses
    torch's GEMM. Initialization is left to the loader: the weights always come from a checkpoint.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        has_bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={has_bias}"
