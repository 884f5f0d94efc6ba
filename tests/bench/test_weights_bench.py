"""`densa bench weights` end to end on a tiny model: every format converted, measured, reported."""

from __future__ import annotations

import json
from pathlib import Path

from densa.cli import main


def test_bench_weights_smoke(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [
        "bench", "weights", "--model", str(tiny_model_dir), "--work-dir", str(tmp_path / "work"),
        "--concurrency", "1", "2", "--prefill-len", "24", "--prompt-len", "8",
        "--output-len", "3", "--repeats", "1", "--num-kv-pages", "64", "--page-size", "4",
        "--max-model-len", "64", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    summary = {row["format"]: row for row in results["summary"]}
    assert set(summary) == {"bf16", "fp8", "int4", "bf16+int4"}
    sizes = {label: row["checkpoint_bytes"] for label, row in summary.items()}
    assert sizes["int4"] < sizes["fp8"] < sizes["bf16"]
    assert sizes["bf16+int4"] == sizes["bf16"] + sizes["int4"]
    assert all(
        row["c=2"]["median"] > 0 and row["prefill"]["median"] > 0 for row in summary.values()
    )
    assert len(results["samples"]) == 4 * 3  # formats x (prefill, c=1, c=2) x 1 repeat
    markdown = (out / "README.md").read_text()
    assert "Profile: decode steps, int4" in markdown and (out / "decode.png").exists()
