"""Fp4Scheme: what differs between MXFP4 and NVFP4 as one value (densa.formats.fp4). Its
attributes against the formats' definitions, its quantizer and reference against the per-scheme
functions, and the names parsed once at the edges (WeightFormat.kind, compressed-tensors)."""

from __future__ import annotations

import pytest
import torch

from densa.formats import fp4
from densa.formats.fp4 import Fp4Scheme
from densa.quant.weight_format import WEIGHT_KINDS, WeightFormat

MX, NV = Fp4Scheme.MXFP4, Fp4Scheme.NVFP4


def test_each_scheme_carries_what_differs() -> None:
    assert (MX.name, MX.group, MX.scale_encoding, MX.has_tensor_scale) == (
        "mxfp4",
        32,
        "e8m0",
        False,
    )
    assert (NV.name, NV.group, NV.scale_encoding, NV.has_tensor_scale) == (
        "nvfp4",
        16,
        "e4m3",
        True,
    )
    assert (MX.bits_per_weight, NV.bits_per_weight) == (4.25, 4.5)
    assert (MX.modelopt_algo, NV.modelopt_algo) == (None, "NVFP4")
    assert (MX.compressed_tensors_strategy, NV.compressed_tensors_strategy) == (
        "group", "tensor_group"
    )  # fmt: skip


def test_names_are_parsed_once_into_the_values() -> None:
    assert Fp4Scheme.named("mxfp4") is MX and Fp4Scheme.named("nvfp4") is NV
    assert Fp4Scheme.named("int4") is None and Fp4Scheme.named("fp8") is None
    assert Fp4Scheme.of_compressed_tensors("mxfp4-pack-quantized") is MX
    assert Fp4Scheme.of_compressed_tensors("nvfp4-pack-quantized") is NV
    assert Fp4Scheme.of_compressed_tensors("pack-quantized") is None
    assert Fp4Scheme.of_compressed_tensors(None) is None
    assert WEIGHT_KINDS == ("int4", "fp8", "mxfp4", "nvfp4")


def test_a_weight_format_names_its_scheme() -> None:
    assert WeightFormat("mxfp4").fp4 is MX
    assert WeightFormat("nvfp4", activations="int8").fp4 is NV
    assert WeightFormat("int4").fp4 is None and not WeightFormat("fp8").is_fp4
    assert WeightFormat("mxfp4").describe() == "mxfp4 (e2m1, e8m0 scale per 32)"
    assert WeightFormat("nvfp4", activations="int8").describe() == (
        "nvfp4 (e2m1, e4m3 scale per 16, fp32 per tensor, int8 activations)"
    )
    with pytest.raises(ValueError, match="round-to-nearest"):
        WeightFormat("nvfp4", method="gptq")


def _weight() -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * 0.05


def test_the_mxfp4_scheme_quantizes_and_dequantizes_as_mxfp4() -> None:
    qweight, scales, t = MX.quantize(_weight())
    want_q, want_s = fp4.quantize_mxfp4(_weight())
    assert t is None and torch.equal(qweight, want_q) and torch.equal(scales, want_s)
    assert scales.shape == (16, 64 // 32)
    assert torch.equal(MX.dequantize(qweight, scales), fp4.dequantize_mxfp4(want_q, want_s))


def test_the_nvfp4_scheme_quantizes_and_dequantizes_as_nvfp4() -> None:
    qweight, scales, t = NV.quantize(_weight())
    want_q, want_s, want_t = fp4.quantize_nvfp4(_weight())
    assert t is not None and torch.equal(t, want_t)
    assert torch.equal(qweight, want_q) and torch.equal(scales, want_s)
    assert scales.shape == (16, 64 // 16)
    want = fp4.dequantize_nvfp4(want_q, want_s, want_t)
    assert torch.equal(NV.dequantize(qweight, scales, t), want)
    with pytest.raises(ValueError, match="tensor scale"):
        NV.dequantize(qweight, scales)
