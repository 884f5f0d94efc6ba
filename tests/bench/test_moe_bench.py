"""`densa bench moe` end to end on a tiny random MoE: the model is written in the per-expert
checkpoint layout, loads with exactly the parameters it claims, and both formats are reported."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from densa.cli import main
from densa.model.arch import ArchConfig
from densa.model.loader import load_model, num_parameters
from densa_bench.moe.runner import MoeShape, make_random_moe


def test_random_moe_has_the_parameters_it_claims(tmp_path: Path, smollm2_dir: Path) -> None:
    shape = MoeShape(
        hidden_size=256, num_layers=2, num_experts=8, top_k=2, expert_intermediate_size=64
    )
    model_dir = make_random_moe(shape, tmp_path / "moe", smollm2_dir)
    assert len(list(model_dir.glob("model-layer-*.safetensors"))) == 2
    arch = ArchConfig.from_dir(model_dir)
    assert arch.moe is not None and arch.moe.num_experts == 8 and arch.moe.top_k == 2
    model = load_model(model_dir, arch, "bfloat16", 64, torch.device("cpu"))
    assert num_parameters(model) == shape.expert_parameters() + shape.other_parameters()
    assert make_random_moe(shape, tmp_path / "moe", smollm2_dir) == model_dir  # made once


def test_bench_moe_smoke(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [
        "bench", "moe", "--work-dir", str(tmp_path / "work"), "--num-layers", "2",
        "--hidden-size", "256", "--num-experts", "8", "--top-k", "2",
        "--expert-intermediate-size", "128", "--concurrency", "1", "4", "--prefill-len", "24",
        "--prompt-len", "8", "--output-len", "3", "--repeats", "1", "--num-kv-pages", "64",
        "--page-size", "4", "--max-model-len", "64", "--no-profile", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["name"] == "moe" and results["settings"]["model_shape"]["num_experts"] == 8
    summary = {row["format"]: row for row in results["summary"]}
    assert set(summary) == {"bf16", "int4"}
    assert summary["int4"]["resident_weight_bytes"] < summary["bf16"]["resident_weight_bytes"]
    assert all(
        row["c=4"]["median"] > 0 and row["prefill"]["median"] > 0 for row in summary.values()
    )
    assert "2 of 8 experts" in results["notes"][0]
    assert (out / "decode.png").exists()
