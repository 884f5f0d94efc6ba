"""The protocol every weight quantizer follows, and the registry that picks one per format.

A quantizer turns one dense [out, in] linear weight into the parts a checkpoint stores
(`quantize`), stored parts into the parts a linear layer runs from (`to_runtime`), and stored
parts back into a dense weight (`dequantize`: references, tests and re-quantization).

Stacked weights -- a mixture-of-experts layer's experts, [experts, out, in] -- go through the same
three methods: each expert is quantized on its own (its own scales, and for GPTQ its own Hessian,
from the tokens routed to it), and every part gains the leading expert dimension. An expert no
calibration token reached has no Hessian; GPTQ falls back to round-to-nearest for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from densa.formats.fp4 import FP4_SCHEME_NAMES
from densa.quant import fp4_weights, fp8_weights, int4
from densa.quant.weight_format import WeightFormat

Parts = dict[str, torch.Tensor]


class WeightQuantizer(Protocol):
    fmt: WeightFormat

    @property
    def needs_calibration(self) -> bool:
        """Whether `quantize` needs the Hessian of the layer's inputs (calibration data)."""
        ...

    def quantize(self, weight: torch.Tensor, hessian: torch.Tensor | None = None) -> Parts:
        """weight [out, in] (hessian [in, in]) or stacked [E, out, in] (hessian [E, in, in])."""
        ...

    def to_runtime(self, parts: Parts) -> Parts: ...

    def dequantize(self, parts: Parts, in_features: int) -> torch.Tensor: ...


def is_stacked(weight: torch.Tensor) -> bool:
    return weight.dim() == 3


def per_expert(fn: Callable[[int], Parts], num_experts: int) -> Parts:
    """Run `fn(expert)` for every expert and stack each part along a new leading dimension."""
    results = [fn(e) for e in range(num_experts)]
    return {name: torch.stack([r[name] for r in results]) for name in results[0]}


def _has_signal(hessian: torch.Tensor | None) -> bool:
    return hessian is not None and bool(hessian.diagonal().any())


class Int4Quantizer:
    """Group-wise INT4; round-to-nearest, or GPTQ given the layer's input Hessian."""

    def __init__(self, fmt: WeightFormat) -> None:
        self.fmt = fmt

    @property
    def needs_calibration(self) -> bool:
        return self.fmt.method == "gptq"

    def quantize(self, weight: torch.Tensor, hessian: torch.Tensor | None = None) -> Parts:
        if is_stacked(weight):
            return per_expert(
                lambda e: self._quantize_expert(weight[e], None if hessian is None else hessian[e]),
                weight.shape[0],
            )
        if self.fmt.method == "gptq" and hessian is None:
            raise ValueError("GPTQ needs the Hessian of the layer's inputs (calibration data)")
        return self._quantize_expert(weight, hessian)

    def _quantize_expert(self, weight: torch.Tensor, hessian: torch.Tensor | None) -> Parts:
        if self.fmt.method == "gptq" and hessian is not None and _has_signal(hessian):
            return int4.quantize_gptq(weight, hessian, self.fmt)
        return int4.quantize_rtn(weight, self.fmt)

    def to_runtime(self, parts: Parts) -> Parts:
        return dict(parts)  # the stored layout is row-major already; kernels pack at load

    def dequantize(self, parts: Parts, in_features: int) -> torch.Tensor:
        if is_stacked(parts["qweight"]):
            experts = range(parts["qweight"].shape[0])
            return torch.stack([self.dequantize(_expert(parts, e), in_features) for e in experts])
        return int4.dequantize(parts, self.fmt, in_features)


class Fp8Quantizer:
    """FP8 e4m3 with square block scales (round-to-nearest)."""

    def __init__(self, fmt: WeightFormat) -> None:
        self.fmt = fmt

    @property
    def needs_calibration(self) -> bool:
        return False

    def quantize(self, weight: torch.Tensor, hessian: torch.Tensor | None = None) -> Parts:
        if is_stacked(weight):
            return per_expert(lambda e: self.quantize(weight[e]), weight.shape[0])
        return fp8_weights.quantize_blocks(weight, self.fmt.block_size)

    def to_runtime(self, parts: Parts) -> Parts:
        if is_stacked(parts["weight"]):
            return per_expert(
                lambda e: self.to_runtime(_expert(parts, e)), parts["weight"].shape[0]
            )
        return fp8_weights.to_runtime(parts, self.fmt.block_size)

    def dequantize(self, parts: Parts, in_features: int) -> torch.Tensor:
        if is_stacked(parts["weight"]):
            experts = range(parts["weight"].shape[0])
            return torch.stack([self.dequantize(_expert(parts, e), in_features) for e in experts])
        return fp8_weights.dequantize(parts, self.fmt.block_size)


class Fp4Quantizer:
    """MXFP4 / NVFP4 (e2m1 codes with block scales), round-to-nearest (densa.quant.fp4_weights)."""

    def __init__(self, fmt: WeightFormat) -> None:
        if fmt.fp4 is None:
            raise ValueError(f"{fmt.kind} is not an FP4 format")
        self.fmt, self.scheme = fmt, fmt.fp4

    @property
    def needs_calibration(self) -> bool:
        return False

    def quantize(self, weight: torch.Tensor, hessian: torch.Tensor | None = None) -> Parts:
        if is_stacked(weight):
            return per_expert(lambda e: self.quantize(weight[e]), weight.shape[0])
        return fp4_weights.quantize(weight, self.scheme)

    def to_runtime(self, parts: Parts) -> Parts:
        return fp4_weights.to_runtime(parts, self.scheme)

    def dequantize(self, parts: Parts, in_features: int) -> torch.Tensor:
        return fp4_weights.dequantize(parts, self.scheme)


def _expert(parts: Parts, expert: int) -> Parts:
    return {name: tensor[expert] for name, tensor in parts.items()}


_QUANTIZERS: dict[str, type[Int4Quantizer] | type[Fp8Quantizer] | type[Fp4Quantizer]] = {
    "int4": Int4Quantizer,
    "fp8": Fp8Quantizer,
    **dict.fromkeys(FP4_SCHEME_NAMES, Fp4Quantizer),  # one quantizer for every FP4 scheme
}


def make_quantizer(fmt: WeightFormat) -> WeightQuantizer:
    return _QUANTIZERS[fmt.kind](fmt)
