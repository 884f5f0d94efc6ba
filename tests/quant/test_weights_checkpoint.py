"""`densa quantize` checkpoints: the format lives in the metadata, every linear layer runs from
it, and a quantized model computes what its dequantized weights compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from densa.cli import main
from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.linear import Fp8Linear, Int4Linear, Linear, resident_weight_bytes
from densa.model.loader import load_model
from densa.model.quantize import QuantizeSettings, quantize_checkpoint, run_sequence
from densa.quant.checkpoint import read_format
from densa.quant.weight_format import METADATA_KEY, WeightFormat
from tests.conftest import make_tiny_llama

TOKENS = [1, 520, 9531, 198, 27, 1256, 42, 8000, 3, 77, 10, 11, 12]
FORMATS = {
    "int4-g32-asym": WeightFormat("int4", group_size=32, symmetric=False),
    "int4-g128-sym": WeightFormat("int4", group_size=128, symmetric=True),
    "int4-g64-gptq": WeightFormat("int4", group_size=64, method="gptq"),
    "fp8": WeightFormat("fp8", block_size=64),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    # hidden 192 = 1.5 groups of 128: the CPU int4 op then runs with groups of 64.
    return make_tiny_llama(
        tmp_path_factory.mktemp("src"), smollm2_dir, hidden_size=192, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, source: Path) -> dict[str, Path]:
    out = {}
    for name, fmt in FORMATS.items():
        settings = QuantizeSettings(fmt, calibration_passages=8, show_progress=False)
        out[name] = quantize_checkpoint(
            str(source), tmp_path_factory.mktemp(name), settings
        ).output_dir
    return out


def _logits(
    model_dir: Path, weight_format: str = "auto", tokens: list[int] = TOKENS
) -> torch.Tensor:
    arch = ArchConfig.from_dir(model_dir)
    model = load_model(model_dir, arch, "float32", 64, torch.device("cpu"), weight_format)
    with torch.inference_mode():
        return model.compute_logits(run_sequence(model, arch, tokens))


def test_metadata_describes_every_linear_weight(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["int4-g128-sym"] / "model.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        payload = json.loads(handle.metadata()[METADATA_KEY])
        keys = set(handle.keys())
    assert payload["format"]["kind"] == "int4" and payload["format"]["group_size"] == 128
    tensors = payload["tensors"]
    # 2 layers x (q, k, v, o, gate, up, down); the embedding and the untied head stay dense.
    assert len(tensors) == 14
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" in keys
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q["shape"] == [192, 192] and set(q["parts"]) == {"qweight", "scales"}
    assert set(q["parts"].values()) <= keys


@pytest.mark.parametrize("name", list(FORMATS))
def test_runtime_matches_the_dequantized_weights(name: str, checkpoints: dict[str, Path]) -> None:
    """The same checkpoint loaded quantized (the kernels) and dequantized (plain fp32 weights)."""
    ckpt = checkpoints[name]
    expected = _logits(ckpt, "dense")
    atol = 0.12 if name.startswith("int4") else 1e-3  # int4 op: bf16 activations (max ~0.06)
    torch.testing.assert_close(_logits(ckpt), expected, atol=atol, rtol=0)
    one_token = _logits(ckpt, tokens=TOKENS[:1])  # decode-sized batches take other kernels
    torch.testing.assert_close(one_token, _logits(ckpt, "dense", TOKENS[:1]), atol=atol, rtol=0)


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantized_model_stays_close_to_the_source(
    name: str, source: Path, checkpoints: dict[str, Path]
) -> None:
    ref, got = _logits(source), _logits(checkpoints[name])
    kl = torch.sum(ref.softmax(-1) * (ref.log_softmax(-1) - got.log_softmax(-1)), -1).mean()
    bound = 0.02 if name == "fp8" else 0.25  # measured 0.005 and 0.04..0.08 (random weights)
    assert kl < bound, float(kl)


def test_layers_and_memory(source: Path, checkpoints: dict[str, Path]) -> None:
    arch = ArchConfig.from_dir(source)
    cpu = torch.device("cpu")
    dense = load_model(source, arch, "float32", 64, cpu)
    int4 = load_model(checkpoints["int4-g128-sym"], arch, "float32", 64, cpu)
    fp8 = load_model(checkpoints["fp8"], arch, "float32", 64, cpu)
    assert isinstance(int4.get_submodule("layers.0.mlp.gate_up_proj"), Int4Linear)
    assert isinstance(fp8.get_submodule("layers.1.self_attn.qkv_proj"), Fp8Linear)
    assert type(int4.get_submodule("lm_head")) is Linear  # the head stays high precision
    assert int4.get_submodule("layers.0.mlp.down_proj").cpu_group_size == 128
    assert int4.get_submodule("layers.0.self_attn.o_proj").cpu_group_size == 64  # K = 192
    linear_bytes = {
        name: sum(resident_weight_bytes(m) for n, m in model.named_modules() if n.endswith("_proj"))
        for name, model in (("dense", dense), ("int4", int4), ("fp8", fp8))
    }
    assert linear_bytes["int4"] < 0.16 * linear_bytes["dense"]  # 4 bits + bf16 scales vs fp32
    assert linear_bytes["fp8"] < 0.27 * linear_bytes["dense"]


def test_weight_format_option(source: Path, checkpoints: dict[str, Path]) -> None:
    arch = ArchConfig.from_dir(source)
    cpu = torch.device("cpu")
    on_the_fly = load_model(source, arch, "float32", 64, cpu, "int4")
    assert isinstance(on_the_fly.get_submodule("layers.0.self_attn.qkv_proj"), Int4Linear)
    dense = load_model(checkpoints["fp8"], arch, "float32", 64, cpu, "dense")
    assert type(dense.get_submodule("layers.0.self_attn.qkv_proj")) is Linear
    with pytest.raises(ModelLoadError, match="stores fp8"):
        load_model(checkpoints["fp8"], arch, "float32", 64, cpu, "int4")


def test_fp8_checkpoint_requantizes_to_int4(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    settings = QuantizeSettings(FORMATS["int4-g32-asym"], show_progress=False)
    result = quantize_checkpoint(str(checkpoints["fp8"]), tmp_path / "int4", settings)
    ckpt = read_format([result.output_dir / "model.safetensors"])
    assert ckpt is not None and ckpt.format.kind == "int4" and len(ckpt.tensors) == 14
    assert result.output_bytes < result.source_bytes


def test_cli_prints_sizes_and_refuses_to_overwrite(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "int4"
    assert main(["quantize", str(source), str(dst), "--weights", "int4", "--group-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "dense src" in out and "int4 g64 sym bfloat16 (rtn): 14 tensors quantized" in out
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["group_size"] == 64
    assert (dst / "tokenizer.json").exists()
    assert main(["quantize", str(source), str(dst), "--weights", "int4"]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert (
        main(["quantize", str(source), str(tmp_path / "x"), "--weights", "fp8", "--method", "gptq"])
        == 2
    )
