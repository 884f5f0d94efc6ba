"""Each shipped quantization layout converts into densa's runtime parts losslessly: densa's
dequantization of the converted parts equals the producer's own dequantization bit for bit
(compressed-tensors' library; AutoAWQ, AutoGPTQ and DeepSeek written from their code in
shipped_producers), and quantization_configs densa would misread are refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from densa.formats.fp8_blocks import dequantize_fp8
from densa.formats.int4 import dequantize_int4
from densa.kernels.cpu.int4_linear import pack_for_cpu
from densa.quant.shipped import ShippedQuantizer
from densa.quant.shipped_config import UnsupportedCheckpoint, parse_quantization_config
from tests.quant.shipped_producers import FP8_CONFIG, producer

# [out, in]: partial 128-blocks in both dimensions for FP8, whole groups of 128 for INT4.
SHAPE = (80, 256)
PRODUCERS = [
    ("deepseek-fp8", 128), ("ct-fp8-block", 128), ("ct-fp8-channel", 128),
    ("ct-int4", 32), ("ct-int4", 128), ("ct-int4-asym", 32), ("ct-int4-asym", 128),
    ("awq", 32), ("awq", 128), ("gptq", 32), ("gptq", 128), ("gptq-asym", 128),
    ("gptq-act", 32), ("gptq-asym-act", 128),
]  # fmt: skip


def _converted(name: str, group_size: int, weight: torch.Tensor) -> tuple[Any, ...]:
    quantize, dequantize, config = producer(name, group_size)
    stored = quantize(weight)
    spec = parse_quantization_config(config, _scale_dtype(stored))
    parts = {part: stored[suffix] for part, suffix in spec.parts.items() if suffix in stored}
    return spec, parts, dequantize(stored)


def _scale_dtype(stored: dict[str, torch.Tensor]) -> str:
    scale = stored.get("weight_scale", stored.get("scales"))
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
    return names.get(scale.dtype, "float32") if scale is not None else "float32"


def _densa_dequant(spec: Any, runtime: dict[str, torch.Tensor]) -> torch.Tensor:
    if spec.fmt.kind == "fp8":
        return dequantize_fp8(runtime["weight"], runtime["weight_scale"], spec.fmt.block_size)
    return dequantize_int4(
        runtime["qweight"], runtime["scales"], runtime.get("zeros"), spec.fmt.group_size, SHAPE[1]
    )


@pytest.mark.parametrize(("name", "group_size"), PRODUCERS)
def test_converted_weights_equal_the_producers_dequantization(name: str, group_size: int) -> None:
    weight = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)) * 0.05
    spec, parts, reference = _converted(name, group_size, weight)
    quantizer = ShippedQuantizer(spec.producer, spec.fmt)
    assert torch.equal(quantizer.dequantize(parts, SHAPE), reference)
    if "act" in name:  # no contiguous groups: such layers load dequantized (the line above)
        return
    runtime = quantizer.to_runtime(parts, SHAPE)
    assert torch.equal(_densa_dequant(spec, runtime), reference)
    assert (weight - reference).abs().max() < 0.05  # the layout was read, not just copied


def test_the_int4_layouts_keep_their_bits_in_densas_format() -> None:
    """Symmetric compressed-tensors INT4 keeps its bf16 scales and runs on torch's packed op;
    zero points (and fp16 scales) need float32 / fp16 values the op would round, so those
    layers run dequantize-then-matmul."""
    weight = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2)) * 0.05
    for name, fmt_dtype, on_torch_op in (
        ("ct-int4", torch.bfloat16, True),
        ("ct-int4-asym", torch.float32, False),
        ("awq", torch.float32, False),
        ("gptq", torch.float16, False),
    ):
        spec, parts, _ = _converted(name, 128, weight)
        runtime = ShippedQuantizer(spec.producer, spec.fmt).to_runtime(parts, SHAPE)
        assert runtime["scales"].dtype == fmt_dtype == spec.fmt.torch_scale_dtype, name
        assert ("zeros" in runtime) == (not spec.fmt.symmetric), name
        pack = pack_for_cpu(runtime["qweight"], runtime["scales"], runtime.get("zeros"),
                            128, SHAPE[1])  # fmt: skip
        assert (pack is not None) == on_torch_op, name


def test_unknown_and_ignored_keys_are_refused_by_name() -> None:
    with pytest.raises(UnsupportedCheckpoint, match=r"\['colour', 'rotation'\]"):
        parse_quantization_config({**FP8_CONFIG, "rotation": "hadamard", "colour": 1}, "float32")
    with pytest.raises(UnsupportedCheckpoint, match="activation_scheme"):
        parse_quantization_config({**FP8_CONFIG, "activation_scheme": "static"}, "float32")
    with pytest.raises(UnsupportedCheckpoint, match="square blocks"):
        parse_quantization_config({**FP8_CONFIG, "weight_block_size": [128, 64]}, "float32")
    _, _, gptq = producer("gptq", 128)
    with pytest.raises(UnsupportedCheckpoint, match=r"\['use_exl2'\]"):
        parse_quantization_config({**gptq, "use_exl2": True}, "float16")
    with pytest.raises(UnsupportedCheckpoint, match="bits = 8"):
        parse_quantization_config({**gptq, "bits": 8}, "float16")
    _, _, awq = producer("awq", 128)
    with pytest.raises(UnsupportedCheckpoint, match="version = 'gemv'"):
        parse_quantization_config({**awq, "version": "gemv"}, "float16")
    _, _, ct = producer("ct-int4-asym", 32)
    ct["config_groups"]["group_0"]["weights"]["strategy"] = "channel"
    with pytest.raises(UnsupportedCheckpoint, match="strategy = 'channel'"):
        parse_quantization_config(ct, "bfloat16")
    with pytest.raises(UnsupportedCheckpoint, match="quant_method 'bitsandbytes'"):
        parse_quantization_config({"quant_method": "bitsandbytes"}, "float32")
