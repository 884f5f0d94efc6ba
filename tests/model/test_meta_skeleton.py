"""Models are built on the meta device without random init, and building an engine does not
pull in torch's compiler stack (torch._dynamo, and with it triton) on a CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from densa.model.registry import meta_skeleton


def test_the_skeleton_is_meta_and_init_comes_back_even_after_an_error() -> None:
    normal = torch.nn.init.normal_
    with pytest.raises(RuntimeError, match="boom"), meta_skeleton():
        layer = torch.nn.Linear(4, 3)
        embedding = torch.nn.Embedding(10, 4)
        assert layer.weight.is_meta and embedding.weight.is_meta
        assert torch.nn.init.normal_ is not normal
        raise RuntimeError("boom")
    assert torch.nn.init.normal_ is normal
    assert not torch.nn.Linear(4, 3).weight.is_meta


_BUILD = """
import sys
from densa.setup.args import EngineArgs
from densa.engine.llm_engine import LLMEngine
LLMEngine.from_args(EngineArgs(model=sys.argv[1], num_kv_pages=8, max_model_len=32))
print(sorted(m for m in ("torch._dynamo", "triton") if m in sys.modules))
"""


def test_building_an_engine_imports_no_compiler(tiny_model_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _BUILD, str(tiny_model_dir)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stderr[-2000:]
