"""Loading shipped checkpoints (densa.quant.shipped) through the loader's planning: the memory
plan is the bytes the loader holds, another runtime format converts at load time, and a
quantization_config densa cannot honour fails the load with the key named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.linear import Fp8Linear, Int4Linear, Linear, resident_weight_bytes
from densa.model.loader import load_model
from densa.setup.memory_plan import plan_weights
from tests.conftest import make_tiny_llama
from tests.quant.shipped_producers import write_shipped

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("src"), smollm2_dir)


@pytest.mark.parametrize(
    ("name", "weight_format", "kind"),
    [
        ("deepseek-fp8", "auto", Fp8Linear),
        ("deepseek-fp8", "fp8", Fp8Linear),
        ("deepseek-fp8", "dense", Linear),
        ("ct-int4-asym", "auto", Int4Linear),
        ("gptq-act", "auto", Linear),  # act-order: dequantized
    ],
)
def test_planned_weights_are_the_loaded_bytes(
    name: str, weight_format: str, kind: type, source: Path, tmp_path: Path
) -> None:
    shipped = write_shipped(source, tmp_path / "shipped", tmp_path / "ref", name)
    arch = ArchConfig.from_dir(shipped)
    plan = plan_weights(shipped, arch, "float32", 64, CPU, weight_format, "dense")
    model = load_model(shipped, arch, "float32", 64, CPU, weight_format, "dense")
    assert type(model.get_submodule("layers.1.mlp.down_proj")) is kind
    assert plan.resident_bytes == resident_weight_bytes(model)


def test_a_config_densa_cannot_honour_fails_the_load_naming_it(
    source: Path, tmp_path: Path
) -> None:
    shipped = write_shipped(source, tmp_path / "shipped", tmp_path / "ref", "awq")
    config = json.loads((shipped / "config.json").read_text())
    config["quantization_config"]["exllama_v3"] = True
    (shipped / "config.json").write_text(json.dumps(config))
    arch = ArchConfig.from_dir(shipped)
    with pytest.raises(ModelLoadError, match=r"keys densa does not understand: \['exllama_v3'\]"):
        load_model(shipped, arch, "float32", 64, CPU)


def test_another_quantized_format_at_load_time_points_to_densa_quantize(
    source: Path, tmp_path: Path
) -> None:
    shipped = write_shipped(source, tmp_path / "shipped", tmp_path / "ref", "deepseek-fp8")
    arch = ArchConfig.from_dir(shipped)
    with pytest.raises(ModelLoadError, match="stores fp8 e4m3 128x128 blocks weights, not int4"):
        load_model(shipped, arch, "float32", 64, CPU, "int4")
