"""FP4 checkpoints as their producers ship them: compressed-tensors' mxfp4- and
nvfp4-pack-quantized (its own compressors), NVIDIA ModelOpt's NVFP4 (written from its code in
shipped_producers). Each weight converts without a float copy into densa's FP4 parts whose
dequantization is the producer's own, bit for bit; a tiny Llama loads with its layers in the
C++ kernels' FP4 formats (the memory plan is the bytes loaded), serves transformers' greedy
tokens from the producer's dequantization when asked for dense weights, and stays close to
them on the kernels; configs densa would misread are refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from densa.engine.llm_engine import LLMEngine
from densa.formats import fp4
from densa.kernels.cpu import native
from densa.model.arch import ArchConfig
from densa.model.fp4_linear import Fp4Linear
from densa.model.linear import Linear, resident_weight_bytes
from densa.model.loader import load_model
from densa.model.packed_linear import PackedLinear
from densa.quant.shipped import ShippedQuantizer
from densa.quant.shipped_config import UnsupportedCheckpoint, parse_quantization_config
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from densa.setup.memory_plan import plan_weights
from densa.text.tokenizer import Tokenizer
from tests.conftest import make_tiny_llama
from tests.engine.reference import first_divergence, hf_greedy, run_with_invariants
from tests.quant.shipped_producers import MODELOPT_CONFIG, producer, write_shipped

pytest.importorskip("compressed_tensors")
PRODUCERS = ["ct-mxfp4", "ct-nvfp4", "modelopt-nvfp4"]
SHAPE = (80, 256)
CPU = torch.device("cpu")


def _converted(name: str, weight: torch.Tensor) -> tuple[Any, dict[str, torch.Tensor], Any]:
    quantize, dequantize, config = producer(name)
    stored = quantize(weight)
    spec = parse_quantization_config(config, "float32")
    parts = {part: stored[suffix] for part, suffix in spec.parts.items() if suffix in stored}
    return spec, parts, dequantize(stored)


@pytest.mark.parametrize("name", PRODUCERS)
def test_converted_weights_equal_the_producers_dequantization(name: str) -> None:
    weight = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)) * 0.05
    spec, parts, reference = _converted(name, weight)
    quantizer = ShippedQuantizer(spec.producer, spec.fmt)
    exact = quantizer.dequantize(parts, SHAPE)
    # compressed-tensors returns bfloat16: densa's float32 value is exactly that, unrounded.
    assert torch.equal(exact.to(reference.dtype), reference)
    runtime = quantizer.to_runtime(parts, SHAPE)
    assert runtime["qweight"].dtype == runtime["scales"].dtype == torch.uint8
    assert runtime["qweight"].shape == (SHAPE[0], SHAPE[1] // 2)  # the shipped bytes, 4-bit
    if spec.fmt.kind == "mxfp4":
        kernels = fp4.dequantize_mxfp4(runtime["qweight"], runtime["scales"])
    else:
        kernels = fp4.dequantize_nvfp4(
            runtime["qweight"], runtime["scales"], runtime["tensor_scale"]
        )
    if name == "ct-nvfp4":  # the kernels multiply by 1 / global: within an ulp of the division
        torch.testing.assert_close(kernels, exact, rtol=2**-22, atol=0)
    else:
        assert torch.equal(kernels, exact)
    assert (weight - exact).abs().max() < 0.05  # the layout was read, not just copied


def test_fp4_configs_densa_would_misread_are_refused() -> None:
    with pytest.raises(UnsupportedCheckpoint, match="kv_cache_quant_algo"):
        parse_quantization_config({**MODELOPT_CONFIG, "kv_cache_quant_algo": "FP8"}, "float32")
    with pytest.raises(UnsupportedCheckpoint, match="quant_algo = 'FP8'"):
        parse_quantization_config({**MODELOPT_CONFIG, "quant_algo": "FP8"}, "float32")
    with pytest.raises(UnsupportedCheckpoint, match=r"\['swizzle'\]"):
        parse_quantization_config({"quant_method": "mxfp4", "swizzle": True}, "float32")
    _, _, ct = producer("ct-nvfp4")
    ct["config_groups"]["group_0"]["weights"]["group_size"] = 32
    with pytest.raises(UnsupportedCheckpoint, match="group_size = 32"):
        parse_quantization_config(ct, "float32")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return make_tiny_llama(
        tmp_path_factory.mktemp("src"), smollm2_dir, hidden_size=128, intermediate_size=256
    )


@pytest.mark.parametrize("name", PRODUCERS)
def test_tiny_llama_loads_four_bit_and_serves_the_producers_weights(
    name: str, source: Path, tmp_path: Path
) -> None:
    shipped = write_shipped(source, tmp_path / "shipped", tmp_path / "ref", name)
    arch = ArchConfig.from_dir(shipped)
    kind = "mxfp4" if "mxfp4" in name else "nvfp4"
    plan = plan_weights(shipped, arch, "float32", 64, CPU, "auto", "dense")
    model = load_model(shipped, arch, "float32", 64, CPU, "auto", "dense")
    layer = model.get_submodule("layers.1.mlp.down_proj")
    if native.is_available():
        assert type(layer) is PackedLinear and layer.fmt == f"{kind}a8"  # auto: int8 kernels
    else:
        assert type(layer) is Fp4Linear
    assert plan.resident_bytes == resident_weight_bytes(model)

    tokenizer = Tokenizer.from_dir(shipped)
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def fib(n):\n")]
    refs = hf_greedy(tmp_path / "ref", prompts, 8)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for weight_format in ("dense", kind, "auto"):
        args = EngineArgs(
            model=str(shipped), max_model_len=64, num_kv_pages=32, page_size=16,
            weight_format=weight_format,
        )  # fmt: skip
        engine = LLMEngine.from_args(args)
        if weight_format == "dense":
            assert type(engine.runner.model.get_submodule("layers.0.mlp.down_proj")) is Linear
        ours = run_with_invariants(engine, prompts, greedy)
        if weight_format == "auto" or name == "ct-nvfp4":
            # int8 activations (~0.5% error per layer), or compressed-tensors' bf16-rounded
            # reference weights: on this random model, whose logits are flat, later tokens
            # may part; the first ones agree.
            assert [o[0] for o in ours] == [r.token_ids[0] for r in refs], (name, ours)
        else:  # the producer's own values, float32 activations: transformers' tokens
            assert all(first_divergence(o, r) is None for o, r in zip(ours, refs, strict=True))
