"""`--dtype auto` (the default): a checkpoint stored in bfloat16 stays bfloat16 in memory; float32
checkpoints and GGUF files compute in float32; an explicit --dtype wins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from densa.engine.llm_engine import LLMEngine
from densa.model.loader import auto_dtype
from densa.setup.args import EngineArgs
from tests.conftest import make_tiny_llama


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    from safetensors.torch import load_file, save_file

    out = make_tiny_llama(tmp_path_factory.mktemp("bf16"), smollm2_dir)
    weights = load_file(str(out / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"  # transformers 5's key (torch_dtype before)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_auto_resolves_from_the_checkpoint(bf16_dir: Path, tiny_model_dir: Path) -> None:
    assert auto_dtype(str(bf16_dir), bf16_dir, "auto") == "bfloat16"
    assert auto_dtype(str(tiny_model_dir), tiny_model_dir, "auto") == "float32"
    assert auto_dtype(str(bf16_dir), bf16_dir, "float32") == "float32"
    assert auto_dtype("x.gguf", tiny_model_dir, "auto") == "float32"


@pytest.mark.parametrize(
    ("asked", "expected"), [("auto", torch.bfloat16), ("float32", torch.float32)]
)
def test_bf16_checkpoint_stays_bf16_unless_asked(
    bf16_dir: Path, asked: str, expected: torch.dtype
) -> None:
    engine = LLMEngine.from_args(
        EngineArgs(model=str(bf16_dir), dtype=asked, max_model_len=64, num_kv_pages=16)
    )
    weight = engine.runner.model.get_submodule("layers.0.mlp.down_proj").weight
    assert weight.dtype == expected
    assert engine.config.model.dtype == str(expected).removeprefix("torch.")
