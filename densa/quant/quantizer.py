"""The protocol every weight quantizer follows, and the registry that picks one per format.

A quantizer turns one dense [out, in] linear weight into the parts a checkpoint stores
(`quantize`), stored parts into the parts a linear layer runs from (`to_runtime`), and stored
parts back into a dense weight (`dequantize`: references, tests and re-quantization).
"""

from __future__ import annotations

from typing import Protocol

import torch

from densa.quant import fp8_weights, int4
from densa.quant.weight_format import WeightFormat

Parts = dict[str, torch.Tensor]


class WeightQuantizer(Protocol):
    fmt: WeightFormat

    @property
    def needs_calibration(self) -> bool:
        """Whether `quantize` needs the Hessian of the layer's inputs (calibration data)."""
        ...

    def quantize(self, weight: torch.Tensor, hessian: torch.Tensor | None = None) -> Parts: ...

    def to_runtime(self, parts: Parts) -> Parts: ...

    def dequantize(self, parts: Parts, in_features: int) -> torch.Tensor: ...


class Int4Quantizer:
    """Group-wise INT4; round-to-nearest, or GPTQ given the layer's input Hessian."""

    def __init__(self, fmt: WeightFormat) -> None:
        self.fmt = fmt

    @property
    def needs_calibration(self) -> bool:
        return self.fmt.method == "gptq"

    def quantize(self, weight: torch.Tensor, hessian: torch.Tensor | None = None) -> Parts:
        if self.fmt.method == "rtn":
            return int4.quantize_rtn(weight, self.fmt)
        if hessian is None:
            raise ValueError("GPTQ needs the Hessian of the layer's inputs (calibration data)")
        return int4.quantize_gptq(weight, hessian, self.fmt)

    def to_runtime(self, parts: Parts) -> Parts:
        return dict(parts)  # the stored layout is row-major already; kernels pack at load

    def dequantize(self, parts: Parts, in_features: int) -> torch.Tensor:
        return int4.dequantize(parts, self.fmt, in_features)


class Fp8Quantizer:
    """FP8 e4m3 with square block scales (round-to-nearest)."""

    def __init__(self, fmt: WeightFormat) -> None:
        self.fmt = fmt

    @property
    def needs_calibration(self) -> bool:
        return False

    def quantize(self, weight: torch.Tensor, hessian: torch.Tensor | None = None) -> Parts:
        return fp8_weights.quantize_blocks(weight, self.fmt.block_size)

    def to_runtime(self, parts: Parts) -> Parts:
        return fp8_weights.to_runtime(parts, self.fmt.block_size)

    def dequantize(self, parts: Parts, in_features: int) -> torch.Tensor:
        return fp8_weights.dequantize(parts, self.fmt.block_size)


_QUANTIZERS: dict[str, type[Int4Quantizer] | type[Fp8Quantizer]] = {
    "int4": Int4Quantizer,
    "fp8": Fp8Quantizer,
}


def make_quantizer(fmt: WeightFormat) -> WeightQuantizer:
    return _QUANTIZERS[fmt.kind](fmt)
