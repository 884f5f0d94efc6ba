"""`densa quantize --weights mxfp4|nvfp4` from an FP8 block-scaled checkpoint as shipped
(DeepSeek's layout) and from BF16: each weight is densa.formats.fp4's round-to-nearest of the
source weight's exact value (routed experts included); the FP4 checkpoint declares its source's
lineage, so a prefill(FP8) -> decode(MXFP4) split pairs up and serves what one phase-aware
server does; the memory plan of the FP4 checkpoint is the bytes it loads (4-bit, no copy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from densa.formats import fp4
from densa.model.arch import ArchConfig
from densa.model.lineage import checkpoint_lineage
from densa.model.linear import resident_weight_bytes
from densa.model.loader import load_model
from densa.model.quantize import QuantizeSettings, quantize_checkpoint
from densa.quant.weight_format import WeightFormat
from densa.sampling_params import SamplingParams
from densa.setup.memory_plan import plan_weights
from tests.conftest import make_tiny_llama
from tests.disagg.support import colocated_tokens, make_pair
from tests.quant.shipped_producers import deepseek_dequant, write_shipped
from tests.tiny_families import save_tiny

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPT = [(7 * i + 3) % 500 + 10 for i in range(40)]
SMALL = {"num_kv_pages": 16, "max_model_len": 128}


def _fp8_value(fp8: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    parts = {
        "weight": fp8[f"{module}.weight"],
        "weight_scale_inv": fp8[f"{module}.weight_scale_inv"],
    }
    return deepseek_dequant(parts)


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
def test_fp4_weights_are_rtn_of_the_exact_fp8_values_experts_included(
    kind: str, tmp_path: Path, smollm2_dir: Path
) -> None:
    source = save_tiny("deepseek_v3", tmp_path / "src", smollm2_dir)
    fp8_dir = write_shipped(source, tmp_path / "fp8", tmp_path / "ref", "deepseek-fp8")
    out_dir = tmp_path / kind
    quantize_checkpoint(str(fp8_dir), out_dir, QuantizeSettings(WeightFormat(kind),
                                                                show_progress=False))  # fmt: skip
    fp8, out = (
        load_file(str(fp8_dir / "model.safetensors")),
        load_file(str(out_dir / "model.safetensors")),
    )
    quantize = fp4.quantize_mxfp4 if kind == "mxfp4" else fp4.quantize_nvfp4
    layer = "model.layers.0.mlp.down_proj"
    expected = quantize(_fp8_value(fp8, layer))
    assert torch.equal(out[f"{layer}.weight.qweight"], expected[0])
    assert torch.equal(out[f"{layer}.weight.scales"], expected[1])
    stacked = out["model.layers.1.mlp.experts.up_proj.weight.qweight"]  # [E, out, in/2] uint8
    for expert in (0, 7):
        module = f"model.layers.1.mlp.experts.{expert}.up_proj"
        assert torch.equal(stacked[expert], quantize(_fp8_value(fp8, module))[0])
    assert checkpoint_lineage(out_dir) == checkpoint_lineage(fp8_dir)


@pytest.fixture(scope="module")
def fp8_and_mxfp4(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("llama-fp8-fp4")
    fp8 = write_shipped(make_tiny_llama(root / "src", smollm2_dir), root / "fp8", root / "ref",
                        "deepseek-fp8")  # fmt: skip
    mxfp4 = root / "mxfp4"
    quantize_checkpoint(str(fp8), mxfp4, QuantizeSettings(WeightFormat("mxfp4"),
                                                          show_progress=False))  # fmt: skip
    return fp8, mxfp4


def test_prefill_fp8_decode_mxfp4_split_serves_the_phase_aware_tokens(
    fp8_and_mxfp4: tuple[Path, Path],
) -> None:
    fp8_dir, mxfp4_dir = fp8_and_mxfp4
    assert checkpoint_lineage(mxfp4_dir) == checkpoint_lineage(fp8_dir)
    expected = colocated_tokens(fp8_dir, [PROMPT], GREEDY, decode_model=str(mxfp4_dir), **SMALL)
    pair = make_pair(fp8_dir, SMALL, {**SMALL, "model": str(mxfp4_dir)}, timeout_s=5.0)
    pair.submit(PROMPT, GREEDY, "r")
    pair.run()
    assert pair.tokens("r") == expected[0]
    pair.assert_all_free()


@pytest.mark.parametrize("weight_format", ["auto", "mxfp4"])
def test_the_memory_plan_is_the_fp4_bytes_loaded(
    fp8_and_mxfp4: tuple[Path, Path], weight_format: str
) -> None:
    _, mxfp4_dir = fp8_and_mxfp4
    cpu = torch.device("cpu")
    arch = ArchConfig.from_dir(mxfp4_dir)
    plan = plan_weights(mxfp4_dir, arch, "float32", 64, cpu, weight_format, "dense")
    model = load_model(mxfp4_dir, arch, "float32", 64, cpu, weight_format, "dense")
    assert plan.resident_bytes == resident_weight_bytes(model)
    down = model.get_submodule("layers.0.mlp.down_proj")
    assert sum(b.numel() for b in down.buffers()) == 64 * 128 * 17 // 32  # 4.25 bits per weight
