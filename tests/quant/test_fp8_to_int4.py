"""`densa quantize` from an FP8 block-scaled checkpoint as shipped (DeepSeek's layout) to densa's
INT4: each weight is the RTN quantization of the FP8 weight's exact dequantization (routed experts
included), the INT4 checkpoint declares the FP8 one's lineage, and a prefill(FP8) ->
decode(INT4) split serves what one phase-aware server does, while an unrelated INT4 checkpoint
of the same architecture and tokenizer is refused at the handshake."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from densa.model.lineage import checkpoint_lineage
from densa.model.quantize import QuantizeSettings, quantize_checkpoint
from densa.quant import int4
from densa.quant.weight_format import WeightFormat
from densa.sampling_params import SamplingParams
from tests.conftest import make_tiny_llama
from tests.disagg.support import colocated_tokens, make_pair
from tests.quant.shipped_producers import deepseek_dequant, write_shipped
from tests.tiny_families import save_tiny

INT4 = WeightFormat("int4", group_size=32)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPT = [(7 * i + 3) % 500 + 10 for i in range(40)]
SMALL = {"num_kv_pages": 16, "max_model_len": 128}


def _fp8_and_int4(root: Path, source: Path) -> tuple[Path, Path]:
    fp8 = write_shipped(source, root / "fp8", root / "ref", "deepseek-fp8")
    int4_dir = root / "int4"
    quantize_checkpoint(str(fp8), int4_dir, QuantizeSettings(INT4, show_progress=False))
    return fp8, int4_dir


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("llama-fp8")
    return _fp8_and_int4(root, make_tiny_llama(root / "src", smollm2_dir))


def _rtn_of_fp8(fp8: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
    parts = {
        "weight": fp8[f"{module}.weight"],
        "weight_scale_inv": fp8[f"{module}.weight_scale_inv"],
    }
    return int4.quantize_rtn(deepseek_dequant(parts), INT4)


def test_int4_weights_are_rtn_of_the_exact_fp8_values_experts_included(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    source = save_tiny("deepseek_v3", tmp_path / "src", smollm2_dir)
    fp8_dir, int4_dir = _fp8_and_int4(tmp_path, source)
    fp8 = load_file(str(fp8_dir / "model.safetensors"))
    out = load_file(str(int4_dir / "model.safetensors"))
    dense_layer = "model.layers.0.mlp.down_proj"
    expected = _rtn_of_fp8(fp8, dense_layer)
    assert torch.equal(out[f"{dense_layer}.weight.qweight"], expected["qweight"])
    assert torch.equal(out[f"{dense_layer}.weight.scales"], expected["scales"])
    stacked = out["model.layers.1.mlp.experts.gate_proj.weight.qweight"]  # [experts, out, in/2]
    for expert in (0, 7):
        module = f"model.layers.1.mlp.experts.{expert}.gate_proj"
        assert torch.equal(stacked[expert], _rtn_of_fp8(fp8, module)["qweight"])
    # MLA's kv_b_proj is kept in high precision: the FP8 values, dequantized, as bf16.
    kv_b = "model.layers.0.self_attn.kv_b_proj"
    parts = {"weight": fp8[f"{kv_b}.weight"], "weight_scale_inv": fp8[f"{kv_b}.weight_scale_inv"]}
    assert torch.equal(out[f"{kv_b}.weight"], deepseek_dequant(parts).to(torch.bfloat16))


def test_the_int4_checkpoint_declares_the_fp8_ones_lineage(
    llama_pair: tuple[Path, Path], tmp_path: Path, smollm2_dir: Path
) -> None:
    fp8_dir, int4_dir = llama_pair
    assert checkpoint_lineage(int4_dir) == checkpoint_lineage(fp8_dir)
    again = tmp_path / "int4-g128"  # a conversion of the conversion keeps the root's lineage
    quantize_checkpoint(str(int4_dir), again, QuantizeSettings(WeightFormat("int4"),
                                                               show_progress=False))  # fmt: skip
    assert checkpoint_lineage(again) == checkpoint_lineage(fp8_dir)
    other = make_tiny_llama(tmp_path / "other", smollm2_dir, seed=1)  # same shapes, tokenizer
    assert checkpoint_lineage(other) != checkpoint_lineage(fp8_dir)


def test_prefill_fp8_decode_int4_split_serves_the_phase_aware_tokens(
    llama_pair: tuple[Path, Path],
) -> None:
    fp8_dir, int4_dir = llama_pair
    expected = colocated_tokens(fp8_dir, [PROMPT], GREEDY, decode_model=str(int4_dir), **SMALL)
    pair = make_pair(fp8_dir, SMALL, {**SMALL, "model": str(int4_dir)}, timeout_s=5.0)
    pair.submit(PROMPT, GREEDY, "r")
    pair.run()
    assert pair.tokens("r") == expected[0]
    assert pair.d_agent.stats.counts["pages"] == 3
    pair.assert_all_free()


def test_an_unrelated_int4_checkpoint_is_refused_at_the_handshake(
    llama_pair: tuple[Path, Path], tmp_path: Path, smollm2_dir: Path
) -> None:
    fp8_dir, _ = llama_pair
    other = make_tiny_llama(tmp_path / "other", smollm2_dir, seed=1)
    _, unrelated = _fp8_and_int4(tmp_path, other)
    pair = make_pair(fp8_dir, SMALL, {**SMALL, "model": str(unrelated)}, timeout_s=5.0)
    pair.submit(PROMPT, GREEDY, "r")
    pair.run()
    final = pair.final("r")
    assert final.finish_reason == "error" and final.error_code == "kv_peer_mismatch"
    assert "the weights come from different checkpoints" in (final.error or "")
    pair.assert_all_free()


def test_gptq_from_the_fp8_checkpoint_loads_and_keeps_the_lineage(
    llama_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """GPTQ calibrates on the FP8 checkpoint loaded as shipped (dequantized for calibration)."""
    fp8_dir, _ = llama_pair
    gptq = WeightFormat("int4", group_size=32, method="gptq")
    settings = QuantizeSettings(gptq, calibration_passages=4, show_progress=False)
    result = quantize_checkpoint(str(fp8_dir), tmp_path / "gptq", settings)
    assert result.calibration_tokens > 0 and result.num_quantized == 14  # 2 layers x 7
    assert checkpoint_lineage(tmp_path / "gptq") == checkpoint_lineage(fp8_dir)
    tokens = colocated_tokens(tmp_path / "gptq", [PROMPT], GREEDY, **SMALL)[0]
    assert len(tokens) == GREEDY.max_tokens
