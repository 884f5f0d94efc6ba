"""Linear layers: the dense one, and the quantized formats that replace it (INT4, FP8 weights;
the FP4 ones live in densa.model.fp4_linear).

Every variant computes y = x W^T (+ b) for x [M, in] and keeps each weight-shaped parameter with
one row per output feature, so the loader fills fused projections (q|k|v, gate|up) row by row
whatever the format. Initialization is left to the loader: weights always come from a checkpoint.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from densa.formats.fp4 import FP4_SCHEME_NAMES
from densa.formats.int4 import dequantize_int4
from densa.kernels.cpu import linear as cpu_linear
from densa.kernels.cpu.fp8_linear import fp8_linear
from densa.kernels.cpu.int4_linear import cpu_int4_linear, pack_for_cpu
from densa.model.fp4_linear import Fp4Linear
from densa.model.frozen import frozen_parameter as _frozen
from densa.quant.weight_format import WeightFormat


class Linear(nn.Module):
    """Dense weights [out_features, in_features], like nn.Linear.

    Small CPU batches (decode) stream the weights through a fused kernel; everything else uses
    torch's GEMM.
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


class Int4Linear(nn.Module):
    """Group-wise INT4 weights (layout: densa.kernels.cpu.int4_linear), activations in any dtype.

    Runs on CPU through torch's packed int4 matmul (bf16 activations) when the shape allows,
    on CUDA through the Triton kernel, and otherwise dequantizes and multiplies.
    """

    cpu_packed: torch.Tensor  # buffers `prepare` registers for torch's CPU op
    cpu_scales_and_zeros: torch.Tensor

    def __init__(
        self, in_features: int, out_features: int, bias: bool, fmt: WeightFormat, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        num_groups = math.ceil(in_features / fmt.group_size)
        self.qweight = _frozen((out_features, math.ceil(in_features / 2)), torch.uint8)
        self.scales = _frozen((out_features, num_groups), fmt.torch_scale_dtype)
        self.zeros = None if fmt.symmetric else _frozen(self.scales.shape, fmt.torch_scale_dtype)
        self.bias = _frozen((out_features,), dtype) if bias else None
        self.cpu_group_size = 0  # > 0 once `prepare` has built torch's packed layout

    def prepare(self) -> None:
        """After loading: build torch's CPU layout and drop the row-major copy it replaces."""
        if self.qweight.device.type != "cpu":
            return
        pack = pack_for_cpu(
            self.qweight, self.scales, self.zeros, self.fmt.group_size, self.in_features
        )
        if pack is None:
            return  # shape outside the op's constraints: keep dequantize-then-matmul
        self.register_buffer("cpu_packed", pack.packed, persistent=False)
        self.register_buffer("cpu_scales_and_zeros", pack.scales_and_zeros, persistent=False)
        self.cpu_group_size = pack.group_size
        self.qweight = _frozen((0,), torch.uint8)
        self.scales = _frozen((0,), self.fmt.torch_scale_dtype)
        self.zeros = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_group_size:
            return cpu_int4_linear(
                x, self.cpu_packed, self.cpu_scales_and_zeros, self.cpu_group_size, self.bias
            )
        if x.is_cuda:
            from densa.kernels.triton import (
                int4_linear as triton_int4,  # imports Triton: only when a GPU is in use
            )

            if triton_int4.is_available():
                return triton_int4.int4_linear_triton(
                    x, self.qweight, self.scales, self.zeros, self.fmt.group_size, self.bias
                )
        weight = dequantize_int4(
            self.qweight, self.scales, self.zeros, self.fmt.group_size, self.in_features
        )
        return F.linear(x, weight.to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " + (
            self.fmt.describe()
        )


class Fp8Linear(nn.Module):
    """FP8 e4m3 weights with per-row block scales (layout: densa.kernels.cpu.fp8_linear)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, fmt: WeightFormat, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        num_blocks = math.ceil(in_features / fmt.block_size)
        self.weight = _frozen((out_features, in_features), torch.float8_e4m3fn)
        self.weight_scale = _frozen((out_features, num_blocks), torch.float32)
        self.bias = _frozen((out_features,), dtype) if bias else None

    def prepare(self) -> None:
        """Nothing to convert: the kernels read the loaded layout directly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from densa.kernels.triton import (
                fp8_linear as triton_fp8_linear,  # imports Triton: only on a GPU
            )

            if triton_fp8_linear.triton is not None:
                return triton_fp8_linear.fp8_linear_triton(
                    x, self.weight, self.weight_scale, self.fmt.block_size, self.bias
                )
        return fp8_linear(x, self.weight, self.weight_scale, self.fmt.block_size, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " + (
            self.fmt.describe()
        )


_QUANTIZED: dict[str, type[Int4Linear] | type[Fp8Linear] | type[Fp4Linear]] = {
    "int4": Int4Linear,
    "fp8": Fp8Linear,
    **dict.fromkeys(FP4_SCHEME_NAMES, Fp4Linear),  # one layer type for every FP4 scheme
}


def quantize_linears(model: nn.Module, names: set[str], fmt: WeightFormat) -> None:
    """Swap the named dense `Linear` modules for empty quantized ones (before loading)."""
    for name in sorted(names):
        dense = model.get_submodule(name)
        if not isinstance(dense, Linear):
            raise TypeError(f"{name} is a {type(dense).__name__}, not a Linear layer")
        dtype = dense.weight.dtype
        quantized = _QUANTIZED[fmt.kind](
            dense.in_features, dense.out_features, dense.bias is not None, fmt, dtype
        )
        model.set_submodule(name, quantized.to(dense.weight.device))


def prepare_quantized(model: nn.Module) -> None:
    """Convert every loaded quantized linear to the layout its kernels run from (an FP4 layer
    the C++ kernels run becomes a PackedLinear of its format)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, Int4Linear | Fp8Linear):
            module.prepare()
        elif isinstance(module, Fp4Linear):
            packed = module.packed()
            if packed is not None:
                model.set_submodule(name, packed)


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, tensors sharing memory (tied weights) counted once.

    Counts each tensor's own bytes rather than its storage's: after `rehome_on_huge_pages` all
    weights are views into one region, whose storage is the whole model."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        nbytes = tensor.numel() * tensor.element_size()
        key = (tensor.data_ptr(), nbytes)
        if key in seen or tensor.device.type == "meta":
            continue
        seen.add(key)
        total += nbytes
    return total
