"""`densa bench step-bytes` on the tiny model: a decode step's message stays the same size as the
context grows (deltas), while the old contract's snapshot of the same step grows with it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from densa.cli import main


def test_decode_steps_cost_the_same_bytes_however_long_the_context(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_dir = tmp_path / "step_bytes"
    argv = ["bench", "step-bytes", "--model", str(tiny_model_dir), "--concurrency", "4",
            "--prompt-len", "40", "--output-len", "24", "--page-size", "4",
            "--kv-cache-memory", "64MiB", "--out", str(out_dir)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["densa", *argv])
    assert main(argv) == 0
    samples = json.loads((out_dir / "results.json").read_text())["samples"]
    decodes = [s for s in samples if s["requests"] == 4 and s["tokens"] == 4]
    assert len(decodes) >= 20
    first, last = decodes[0], decodes[-1]
    # A decode step names 4 tokens, maybe a new page each and its tag change: bounded bytes.
    assert max(s["delta_bytes"] for s in decodes) - min(s["delta_bytes"] for s in decodes) < 200
    # The snapshot re-sends every output token and page so far: 22 more tokens per request.
    assert last["snapshot_bytes"] > first["snapshot_bytes"] + 4 * 22
    assert all(s["delta_bytes"] < s["snapshot_bytes"] for s in decodes)
    assert (out_dir / "README.md").is_file() and (out_dir / "bytes_per_step.png").is_file()
