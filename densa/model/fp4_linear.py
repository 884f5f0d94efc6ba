"""Linear layers over FP4 weights (MXFP4, NVFP4) as checkpoints ship them: the row-major parts of
densa.formats.fp4 are loaded as they are (4-bit codes, one scale byte per group; never a float
copy), then laid out for the kernel that runs them:

    CPU with densa's C++ kernels  `prepare` packs them into the kernels' panels (4.25 / 4.5 bits
                                  per weight, as stored): a dense layer becomes a PackedLinear
                                  of format mxfp4a8 / nvfp4a8 (int8 activations, `auto`'s
                                  choice) or mxfp4 / nvfp4 (weight-only), which the fused decode
                                  step runs too; a stacked one keeps one packed weight per
                                  expert
    CUDA                          the Triton kernel over the row-major parts
                                  (densa.kernels.triton.fp4_linear)
    otherwise                     dequantize (the reference) and multiply

    Fp4Linear         qweight [N, K/2] uint8, scales [N, K/g] uint8, tensor_scale [N] (NVFP4)
    StackedFp4Linear  the same with a leading expert dimension [E, ...]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from densa.formats.fp4 import Fp4Scheme
from densa.kernels.cpu import native, qgemm
from densa.kernels.cpu.grouped_linear import ExpertSegments
from densa.model.frozen import frozen_parameter as _frozen
from densa.model.packed_linear import PackedLinear
from densa.quant.weight_format import WeightFormat


def scheme_of(fmt: WeightFormat) -> Fp4Scheme:
    """The FP4 scheme of a layer's format (ValueError for a format that is not FP4)."""
    if fmt.fp4 is None:
        raise ValueError(f"an FP4 layer cannot hold {fmt.describe()} weights")
    return fmt.fp4


def can_pack(device: torch.device, in_features: int, out_features: int) -> bool:
    """Whether the C++ kernels run this shape here (K % 32, N % 16, kernels built)."""
    return device.type == "cpu" and qgemm.fits(in_features, out_features) and native.is_available()


def pack(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    tensor_scale: torch.Tensor | None,
    fmt: WeightFormat,
) -> qgemm.PackedWeight:
    """The kernels' blocks, for the weight-only kernel or (activations "int8") the int8 one."""
    int8 = fmt.activations == "int8"
    if not scheme_of(fmt).has_tensor_scale:  # MXFP4: the E8M0 scales are all there is
        return qgemm.pack_mxfp4(qweight, scales, native.isa(), int8)
    assert tensor_scale is not None
    return qgemm.pack_nvfp4(qweight, scales, tensor_scale, native.isa(), int8)


def _triton_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    tensor_scale: torch.Tensor | None,
    scheme: Fp4Scheme,
    bias: torch.Tensor | None,
) -> torch.Tensor | None:
    from densa.kernels.triton import fp4_linear as triton_fp4  # imports Triton: only on a GPU

    if not triton_fp4.is_available():
        return None
    return triton_fp4.fp4_linear_triton(x, qweight, scales, tensor_scale, scheme, bias)


class Fp4Linear(nn.Module):
    """y = x W^T (+ b) with W in MXFP4 or NVFP4 (densa.formats.fp4), as loaded."""

    tensor_scale: nn.Parameter | None

    def __init__(
        self, in_features: int, out_features: int, bias: bool, fmt: WeightFormat, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.scheme = scheme = scheme_of(fmt)
        if in_features % scheme.group:
            raise ValueError(
                f"{scheme.name} needs in_features divisible by {scheme.group}: {in_features}"
            )
        self.qweight = _frozen((out_features, in_features // 2), torch.uint8)
        self.scales = _frozen((out_features, in_features // scheme.group), torch.uint8)
        nv = scheme.has_tensor_scale
        self.tensor_scale = _frozen((out_features,), torch.float32) if nv else None
        self.bias = _frozen((out_features,), dtype) if bias else None

    def packed(self) -> PackedLinear | None:
        """The same weights as a PackedLinear for the C++ kernels (None where they do not run)."""
        if not can_pack(self.qweight.device, self.in_features, self.out_features):
            return None
        weight = pack(self.qweight, self.scales, self.tensor_scale, self.fmt)
        name = self.scheme.name + ("a8" if self.fmt.activations == "int8" else "")
        return PackedLinear(name, weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            out = _triton_linear(
                x, self.qweight, self.scales, self.tensor_scale, self.scheme, self.bias
            )
            if out is not None:
                return out
        weight = self.scheme.dequantize(self.qweight, self.scales, self.tensor_scale)
        return F.linear(x, weight.to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " + (
            self.fmt.describe()
        )


class StackedFp4Linear(nn.Module):
    """FP4 experts [E, out, in]: y[rows of e] = x[rows of e] @ W[e]^T, one kernel call per
    active expert (on the CPU, each expert's weight packed for the C++ kernels)."""

    tensor_scale: nn.Parameter | None
    blocks: torch.Tensor  # [E, bytes per expert], once `prepare` has packed them

    def __init__(
        self, num_experts: int, in_features: int, out_features: int, fmt: WeightFormat
    ) -> None:
        super().__init__()
        self.num_experts, self.in_features, self.out_features, self.fmt = (
            num_experts, in_features, out_features, fmt,
        )  # fmt: skip
        self.scheme = scheme = scheme_of(fmt)
        rows = (num_experts, out_features)
        self.qweight = _frozen((*rows, in_features // 2), torch.uint8)
        self.scales = _frozen((*rows, in_features // scheme.group), torch.uint8)
        self.tensor_scale = _frozen(rows, torch.float32) if scheme.has_tensor_scale else None
        self.bits = 0  # the kernels' format code once packed

    def prepare(self) -> None:
        """After loading: pack every expert for the C++ kernels and drop the row-major copy."""
        if not can_pack(self.qweight.device, self.in_features, self.out_features):
            return
        packs = [
            pack(self.qweight[e], self.scales[e],
                 None if self.tensor_scale is None else self.tensor_scale[e], self.fmt)
            for e in range(self.num_experts)
        ]  # fmt: skip
        self.register_buffer("blocks", torch.stack([p.blocks for p in packs]), persistent=False)
        self.bits = packs[0].bits
        self.qweight = _frozen((0,), torch.uint8)
        self.scales = _frozen((0,), torch.uint8)
        self.tensor_scale = None

    def forward(self, x: torch.Tensor, segments: ExpertSegments) -> torch.Tensor:
        """x: [N, in], rows sorted by expert -> [N, out]."""
        out = x.new_empty(x.shape[0], self.out_features)
        for expert, start, end in segments:
            out[start:end] = self._expert_linear(expert, x[start:end])
        return out

    def _expert_linear(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.bits:
            packed = qgemm.PackedWeight(
                self.blocks[expert], self.out_features, self.in_features, self.bits, native.isa()
            )
            return qgemm.quantized_linear(x, packed).to(x.dtype)
        t = None if self.tensor_scale is None else self.tensor_scale[expert]
        if x.is_cuda:
            out = _triton_linear(x, self.qweight[expert], self.scales[expert], t, self.scheme, None)
            if out is not None:
                return out
        weight = self.scheme.dequantize(self.qweight[expert], self.scales[expert], t)
        return F.linear(x, weight.to(x.dtype))

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, " + (
            self.fmt.describe()
        )
