"""`densa quantize` on mixture-of-experts models: stacked [experts, out, in] weights quantized
expert by expert (RTN, GPTQ with per-expert Hessians, FP8), routers / shared-expert gates / MLA's
kv_b_proj kept dense, and INT4 experts run directly by the grouped path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from densa.kernels.cpu.grouped_linear import ExpertSegments
from densa.model.arch import ArchConfig
from densa.model.linear import Int4Linear, Linear
from densa.model.loader import load_model
from densa.model.quantize import QuantizeSettings, quantize_checkpoint, run_sequence
from densa.model.stacked_linear import StackedFp8Linear, StackedInt4Linear, StackedLinear
from densa.quant import int4
from densa.quant.calibration import HessianCollector
from densa.quant.quantizer import Int4Quantizer
from densa.quant.weight_format import METADATA_KEY, WeightFormat
from tests.tiny_families import save_tiny

TOKENS = [1, 520, 9531, 198, 27, 1256, 42, 8000, 3, 77, 10, 11, 12, 300, 301]
FORMATS = {
    "int4-rtn": WeightFormat("int4", group_size=32),
    "int4-gptq": WeightFormat("int4", group_size=32, method="gptq"),
    "fp8": WeightFormat("fp8", block_size=32),
}
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["qwen2_moe", "deepseek_v3"])
def source(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Path:
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param), smollm2_dir)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, source: Path) -> dict[str, Path]:
    out = {}
    for name, fmt in FORMATS.items():
        settings = QuantizeSettings(fmt, calibration_passages=4, show_progress=False)
        out[name] = quantize_checkpoint(
            str(source), tmp_path_factory.mktemp(name), settings
        ).output_dir
    return out


def _moe_layer(model_dir: Path) -> int:
    moe = ArchConfig.from_dir(model_dir).moe
    assert moe is not None
    return moe.moe_layers.index(True)


def _logits(
    model_dir: Path, weight_format: str = "auto", tokens: list[int] = TOKENS
) -> torch.Tensor:
    arch = ArchConfig.from_dir(model_dir)
    model = load_model(model_dir, arch, "float32", 64, CPU, weight_format)
    with torch.inference_mode():
        return model.compute_logits(run_sequence(model, arch, tokens))


def test_metadata_lists_stacked_experts_and_not_the_routers(checkpoints: dict[str, Path]) -> None:
    layer = _moe_layer(checkpoints["int4-rtn"])
    with safe_open(str(checkpoints["int4-rtn"] / "model.safetensors"), framework="pt") as handle:
        tensors = json.loads(handle.metadata()[METADATA_KEY])["tensors"]
        keys = set(handle.keys())
    gate = tensors[f"model.layers.{layer}.mlp.experts.gate_proj.weight"]
    assert gate["shape"] == [8, 32, 64]  # [experts, moe width, hidden]
    assert f"model.layers.{layer}.mlp.gate.weight" in keys  # the router: dense
    assert not any(".mlp.gate.weight" in name or "shared_expert_gate" in name for name in tensors)
    assert not any("kv_b_proj" in name for name in tensors)  # MLA: absorbed into decode


def test_int4_experts_run_directly(source: Path, checkpoints: dict[str, Path]) -> None:
    arch, layer = ArchConfig.from_dir(source), _moe_layer(source)
    model = load_model(checkpoints["int4-rtn"], arch, "float32", 64, CPU)
    experts = model.get_submodule(f"layers.{layer}.mlp.experts.gate_up_proj")
    assert isinstance(experts, StackedInt4Linear) and experts.cpu_group_size == 32
    assert experts.cpu_packed.shape[0] == 8  # one packed weight per expert
    fp8 = load_model(checkpoints["fp8"], arch, "float32", 64, CPU)
    assert isinstance(fp8.get_submodule(f"layers.{layer}.mlp.experts.down_proj"), StackedFp8Linear)
    if arch.mla is not None:
        assert type(model.get_submodule("layers.1.self_attn.kv_b_proj")) is Linear


@pytest.mark.parametrize("name", list(FORMATS))
def test_runtime_matches_the_dequantized_weights(name: str, checkpoints: dict[str, Path]) -> None:
    ckpt = checkpoints[name]
    atol = 0.12 if name.startswith("int4") else 1e-3  # the int4 op takes bf16 activations
    for tokens in (TOKENS, TOKENS[:1]):  # prefill-sized and decode-sized batches
        torch.testing.assert_close(
            _logits(ckpt, tokens=tokens), _logits(ckpt, "dense", tokens), atol=atol, rtol=0
        )


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantized_moe_stays_close_to_the_source(
    name: str, source: Path, checkpoints: dict[str, Path]
) -> None:
    ref, got = _logits(source), _logits(checkpoints[name])
    kl = torch.sum(ref.softmax(-1) * (ref.log_softmax(-1) - got.log_softmax(-1)), -1).mean()
    assert kl < (0.02 if name == "fp8" else 0.3), float(kl)


def test_scopes_keep_shared_experts_or_all_but_experts(source: Path, tmp_path: Path) -> None:
    arch, layer = ArchConfig.from_dir(source), _moe_layer(source)
    fmt = FORMATS["int4-rtn"]
    for scope, kept in (("keep_shared_experts", "shared_expert"), ("experts_only", "self_attn")):
        settings = QuantizeSettings(fmt, show_progress=False, **{scope: True})
        ckpt = quantize_checkpoint(str(source), tmp_path / scope, settings).output_dir
        model = load_model(ckpt, arch, "float32", 64, CPU)
        kept_linears = [n for n, m in model.named_modules() if kept in n and type(m) is Linear]
        assert kept_linears, f"{scope}: nothing named {kept} stayed dense"
        assert not any(kept in n for n, m in model.named_modules() if isinstance(m, Int4Linear))
        experts = model.get_submodule(f"layers.{layer}.mlp.experts.down_proj")
        assert isinstance(experts, StackedInt4Linear)


def test_hessians_are_collected_per_expert() -> None:
    layer = StackedLinear(3, 4, 2)
    layer.weight.data.normal_()
    x = torch.randn(5, 4)
    segments = ExpertSegments.from_counts([3, 0, 2])  # expert 1 gets no rows
    with HessianCollector({"experts": layer}) as collector:
        layer(x, segments)
    hessian = collector.hessians["experts"]
    assert hessian.shape == (3, 4, 4)
    torch.testing.assert_close(hessian[0], (2 * x[:3].T @ x[:3] / 3).double())
    torch.testing.assert_close(hessian[2], (2 * x[3:].T @ x[3:] / 2).double())
    assert not hessian[1].any()
    # An expert without calibration rows is rounded to nearest; the others get GPTQ.
    weight = torch.randn(3, 16, 64)
    parts = Int4Quantizer(WeightFormat("int4", group_size=32, method="gptq")).quantize(
        weight, torch.stack([torch.eye(64).double()] * 3).index_fill_(0, torch.tensor([1]), 0)
    )
    rtn = int4.quantize_rtn(weight[1], WeightFormat("int4", group_size=32))
    assert torch.equal(parts["qweight"][1], rtn["qweight"])
    assert parts["qweight"].shape == (3, 16, 32) and parts["scales"].shape == (3, 16, 2)
