"""Stacked expert weights: one [experts, out, in] tensor per projection of an MoE layer, applied
to rows already sorted by expert (densa.kernels.cpu.grouped_linear), densely or quantized.

Every format keeps one row per output feature in dimension 1 of each weight-shaped part, so the
loader fills fused gate|up rows of all experts at once (densa.model.weight_loading):

    dense   weight  [E, out, in]
    int4    qweight [E, out, ceil(in/2)] uint8, scales [E, out, groups] (+ zeros); run directly by
            torch's packed int4 CPU matmul, one call per active expert (or the Triton kernel)
    fp8     weight  [E, out, in] e4m3, weight_scale [E, out, blocks] float32
    mxfp4 / nvfp4   densa.model.fp4_linear.StackedFp4Linear: e2m1 codes [E, out, in/2] with
            their scale bytes (and NVFP4's tensor scales), packed per expert for the C++ kernels
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from densa.formats.fp4 import FP4_SCHEME_NAMES
from densa.formats.int4 import dequantize_int4
from densa.kernels.cpu.fp8_linear import fp8_linear
from densa.kernels.cpu.grouped_linear import ExpertSegments, grouped_linear
from densa.kernels.cpu.int4_linear import cpu_int4_linear, pack_for_cpu
from densa.model.fp4_linear import StackedFp4Linear
from densa.model.frozen import frozen_parameter as _frozen
from densa.quant.weight_format import WeightFormat


class StackedLinear(nn.Module):
    """Dense expert weights [E, out, in]: y[rows of e] = x[rows of e] @ weight[e]^T."""

    def __init__(self, num_experts: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.num_experts, self.in_features, self.out_features = (
            num_experts, in_features, out_features,
        )  # fmt: skip
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))

    def forward(self, x: torch.Tensor, segments: ExpertSegments) -> torch.Tensor:
        """x: [N, in], rows sorted by expert -> [N, out]."""
        return grouped_linear(x, self.weight, segments)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}"


class StackedInt4Linear(nn.Module):
    """Group-wise INT4 experts (the layout of densa.kernels.cpu.int4_linear, per expert)."""

    cpu_packed: torch.Tensor  # [E, ...] torch's packed layout, built by `prepare`
    cpu_scales_and_zeros: torch.Tensor  # [E, in / group, out, 2]

    def __init__(
        self, num_experts: int, in_features: int, out_features: int, fmt: WeightFormat
    ) -> None:
        super().__init__()
        self.num_experts, self.in_features, self.out_features, self.fmt = (
            num_experts, in_features, out_features, fmt,
        )  # fmt: skip
        num_groups = math.ceil(in_features / fmt.group_size)
        rows = (num_experts, out_features)
        self.qweight = _frozen((*rows, math.ceil(in_features / 2)), torch.uint8)
        self.scales = _frozen((*rows, num_groups), fmt.torch_scale_dtype)
        self.zeros = None if fmt.symmetric else _frozen(self.scales.shape, fmt.torch_scale_dtype)
        self.cpu_group_size = 0  # > 0 once `prepare` has built torch's packed layout

    def prepare(self) -> None:
        """After loading: pack every expert for torch's CPU op, dropping the row-major copy."""
        if self.qweight.device.type != "cpu":
            return
        packs = [
            pack_for_cpu(
                self.qweight[e], self.scales[e], None if self.zeros is None else self.zeros[e],
                self.fmt.group_size, self.in_features,
            )
            for e in range(self.num_experts)
        ]  # fmt: skip
        if any(p is None for p in packs):
            return  # shape outside the op's constraints: dequantize-then-matmul instead
        self.register_buffer("cpu_packed", torch.stack([p.packed for p in packs if p]), False)
        sz = torch.stack([p.scales_and_zeros for p in packs if p])
        self.register_buffer("cpu_scales_and_zeros", sz, persistent=False)
        self.cpu_group_size = packs[0].group_size if packs[0] else 0
        self.qweight = _frozen((0,), torch.uint8)
        self.scales = _frozen((0,), self.fmt.torch_scale_dtype)
        self.zeros = None

    def forward(self, x: torch.Tensor, segments: ExpertSegments) -> torch.Tensor:
        out = x.new_empty(x.shape[0], self.out_features)
        for expert, start, end in segments:
            out[start:end] = self._expert_linear(expert, x[start:end])
        return out

    def _expert_linear(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_group_size:
            return cpu_int4_linear(
                x, self.cpu_packed[expert], self.cpu_scales_and_zeros[expert], self.cpu_group_size
            )
        zeros = None if self.zeros is None else self.zeros[expert]
        if x.is_cuda:
            from densa.kernels.triton import (
                int4_linear as triton_int4,  # imports Triton: only when a GPU is in use
            )

            if triton_int4.is_available():
                return triton_int4.int4_linear_triton(
                    x, self.qweight[expert], self.scales[expert], zeros, self.fmt.group_size, None
                )
        weight = dequantize_int4(
            self.qweight[expert], self.scales[expert], zeros, self.fmt.group_size, self.in_features
        )
        return F.linear(x, weight.to(x.dtype))

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, " + (
            self.fmt.describe()
        )


class StackedFp8Linear(nn.Module):
    """FP8 e4m3 experts with per-row block scales (densa.kernels.cpu.fp8_linear, per expert)."""

    def __init__(
        self, num_experts: int, in_features: int, out_features: int, fmt: WeightFormat
    ) -> None:
        super().__init__()
        self.num_experts, self.in_features, self.out_features, self.fmt = (
            num_experts, in_features, out_features, fmt,
        )  # fmt: skip
        num_blocks = math.ceil(in_features / fmt.block_size)
        self.weight = _frozen((num_experts, out_features, in_features), torch.float8_e4m3fn)
        self.weight_scale = _frozen((num_experts, out_features, num_blocks), torch.float32)

    def prepare(self) -> None:
        """Nothing to convert: the kernels read the loaded layout directly."""

    def forward(self, x: torch.Tensor, segments: ExpertSegments) -> torch.Tensor:
        out = x.new_empty(x.shape[0], self.out_features)
        for expert, start, end in segments:
            out[start:end] = fp8_linear(
                x[start:end], self.weight[expert], self.weight_scale[expert], self.fmt.block_size
            )
        return out

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, " + (
            self.fmt.describe()
        )


_QUANTIZED: dict[str, type[StackedInt4Linear] | type[StackedFp8Linear] | type[StackedFp4Linear]] = {
    "int4": StackedInt4Linear,
    "fp8": StackedFp8Linear,
    **dict.fromkeys(FP4_SCHEME_NAMES, StackedFp4Linear),  # one layer type for every FP4 scheme
}


def quantize_stacked(model: nn.Module, names: set[str], fmt: WeightFormat) -> None:
    """Swap the named dense `StackedLinear` modules for empty quantized ones (before loading)."""
    for name in sorted(names):
        dense = model.get_submodule(name)
        if not isinstance(dense, StackedLinear):
            raise TypeError(f"{name} is a {type(dense).__name__}, not stacked experts")
        quantized = _QUANTIZED[fmt.kind](
            dense.num_experts, dense.in_features, dense.out_features, fmt
        )
        model.set_submodule(name, quantized.to(dense.weight.device))


def prepare_stacked(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, StackedInt4Linear | StackedFp8Linear | StackedFp4Linear):
            module.prepare()
