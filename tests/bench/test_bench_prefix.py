"""`densa bench prefix` end to end on the tiny model: both experiments, interleaved, written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from densa.cli import main


def test_prefix_smoke_run(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_dir = tmp_path / "prefix"
    argv = ["bench", "prefix", "--model", str(tiny_model_dir), "--kv-cache-memory", "16MiB",
            "--max-model-len", "512", "--prefix-lens", "64", "192", "--suffix-len", "8",
            "--repeats", "2", "--turns", "3", "--system-len", "40", "--user-len", "16",
            "--answer-len", "4", "--out", str(out_dir)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["densa", *argv])
    assert main(argv) == 0
    data = json.loads((out_dir / "results.json").read_text())
    shared = [s for s in data["samples"] if s["experiment"] == "shared_prefix"]
    assert [(s["prefix_len"], s["variant"]) for s in shared] == [
        (64, "cached"), (64, "cold"), (192, "cached"), (192, "cold")
    ] * 2  # fmt: skip
    for s in shared:
        assert s["cached_tokens"] == (s["prefix_len"] if s["variant"] == "cached" else 0)
    chat = [s for s in data["samples"] if s["experiment"] == "multi_turn"]
    assert [s["variant"] for s in chat[::3]] == ["cached", "uncached"] * 2
    cached_turns = [s["cached_tokens"] for s in chat[:3]]
    assert cached_turns[0] == 0 and cached_turns[1] < cached_turns[2]
    assert all(s["cached_tokens"] == 0 for s in chat if s["variant"] == "uncached")
    readme = (out_dir / "README.md").read_text()
    assert "Shared prefix: TTFT" in readme and "Headline" in readme
    for plot in ("shared_prefix_ttft", "multi_turn_ttft"):
        assert (out_dir / f"{plot}.png").stat().st_size > 0


def test_prefix_needs_prefix_caching(tmp_path: Path) -> None:
    argv = ["bench", "prefix", "--no-enable-prefix-caching", "--out", str(tmp_path)]
    assert main(argv) == 2
