"""`densa bench integrity` end to end on the tiny model: both variants interleaved, ratios written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from densa.cli import main


def test_integrity_smoke_run(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_dir = tmp_path / "integrity"
    argv = ["bench", "integrity", "--model", str(tiny_model_dir), "--kv-cache-memory", "16MiB",
            "--concurrency", "1", "2", "--prompt-len", "24", "--output-len", "6",
            "--repeats", "2", "--out", str(out_dir)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["densa", *argv])
    assert main(argv) == 0
    data = json.loads((out_dir / "results.json").read_text())
    order = [(s["integrity"], s["concurrency"]) for s in data["samples"]]
    assert order == [("on", 1), ("off", 1), ("on", 2), ("off", 2)] * 2
    for row in data["summary"]:
        assert 0.2 < row["throughput_ratio"]["median"] < 5
        assert row["check_us"] > 0 and 0 < row["check_fraction_of_step"] < 1
    assert (out_dir / "output_tok_s.png").stat().st_size > 0
    assert "on/off throughput" in (out_dir / "README.md").read_text()
