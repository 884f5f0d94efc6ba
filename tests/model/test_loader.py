"""Loader failures are explicit: truncated weights, mismatched checkpoints, models too big to fit,
an unresolved head format; and the head format packs the head as asked."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from densa.engine.llm_engine import LLMEngine
from densa.kernels.cpu import native
from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.loader import check_fits, load_model, plan_load
from densa.model.packed_linear import PackedLinear
from densa.model.quant_targets import OUTPUT_HEAD
from densa.setup.args import EngineArgs
from densa.setup.memory_plan import plan_weights


def test_truncated_safetensors_is_a_clear_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    arch = ArchConfig.from_dir(broken)
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model(broken, arch, "float32", 128, torch.device("cpu"))


def test_checkpoint_that_does_not_match_its_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    mismatched = tmp_path / "mismatched"
    shutil.copytree(tiny_model_dir, mismatched)
    config = (
        (mismatched / "config.json")
        .read_text()
        .replace('"num_hidden_layers": 2', '"num_hidden_layers": 3')
    )
    (mismatched / "config.json").write_text(config)
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(mismatched, ArchConfig.from_dir(mismatched), "float32", 128, torch.device("cpu"))


def test_model_larger_than_memory_is_refused_before_loading(tiny_model_dir: Path) -> None:
    huge = replace(
        ArchConfig.from_dir(tiny_model_dir),
        hidden_size=65536,
        intermediate_size=262144,
        num_layers=200,
    )
    with pytest.raises(ModelLoadError, match=r"only .* is free"):
        load_model(tiny_model_dir, huge, "float32", 128, torch.device("cpu"))
    with pytest.raises(ModelLoadError, match=r"only .* is free"):
        check_fits(10**15, torch.float32, torch.device("cpu"))


def test_kv_budget_too_small_for_one_request(tiny_model_dir: Path) -> None:
    args = EngineArgs(model=str(tiny_model_dir), kv_cache_memory="4KiB", max_model_len=512)
    with pytest.raises(ModelLoadError, match="raise --kv-cache-memory or lower --max-model-len"):
        LLMEngine.from_args(args)


def test_max_model_len_beyond_the_model_context(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="exceeds the model's context of 1024"):
        LLMEngine.from_args(EngineArgs(model=str(tiny_model_dir), max_model_len=4096))


@pytest.mark.skipif(not native.is_available(), reason="packing the head needs the C++ kernels")
@pytest.mark.parametrize("head", ["w8", "dense"])
def test_the_head_format_packs_the_head_and_says_so(tiny_model_dir: Path, head: str) -> None:
    arch, cpu = ArchConfig.from_dir(tiny_model_dir), torch.device("cpu")
    plan = plan_weights(tiny_model_dir, arch, "float32", 128, cpu, "dense", head)
    model = load_model(tiny_model_dir, arch, "float32", 128, cpu, "dense", head)
    packed = isinstance(model.get_submodule(OUTPUT_HEAD), PackedLinear)
    assert packed == (head == "w8")
    assert model.weight_format == ("dense, output head w8" if packed else "dense")
    assert plan.describe == ("float32, head w8" if packed else "float32")


def test_a_head_format_is_resolved_before_the_load(tiny_model_dir: Path) -> None:
    arch, cpu = ArchConfig.from_dir(tiny_model_dir), torch.device("cpu")
    with pytest.raises(ValueError, match="resolved per checkpoint"):
        plan_load(tiny_model_dir, arch, "float32", 128, cpu, "dense", "auto")
    with pytest.raises(ValueError, match="head format must be one of"):
        plan_load(tiny_model_dir, arch, "float32", 128, cpu, "dense", "w4a8")
