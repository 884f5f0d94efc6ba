"""`densa eval ...` end to end on the tiny model: results land as JSON + Markdown (+ PNG)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from densa.cli import main

from .conftest import TINY_PAGES


def _engine_args(model_dir: Path) -> list[str]:
    return ["--model", str(model_dir), "--num-kv-pages", str(TINY_PAGES), "--max-model-len", "1024"]


def _results(out: Path) -> dict:
    assert (out / "README.md").exists()
    return json.loads((out / "results.json").read_text())


def test_distribution_writes_its_report(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "distribution"
    argv = ["eval", "distribution", "--tokens", "96", "--segment-len", "48", "--resamples", "200"]
    argv += ["--test", "bf16:kv_cache_dtype=bfloat16", "--out", str(out)]
    assert main(argv + _engine_args(tiny_model_dir)) == 0
    results = _results(out)
    assert [s["label"] for s in results["summary"]] == ["base", "bf16"]
    assert results["summary"][1]["mean_kl"]["value"] > 0
    assert results["formats"][1] == {"label": "bf16", "options": {"kv_cache_dtype": "bfloat16"}}
    assert results["hardware"]["cpu_count"] and results["date"]
    markdown = (out / "README.md").read_text()
    assert markdown.startswith("# Quality: distribution") and "Command (run " in markdown
    assert "whole segments" in markdown
    assert (out / "kl.png").exists() and (out / "top1.png").exists()


def test_choice_writes_its_report(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "choice"
    argv = ["eval", "choice", "--tasks", "arc_challenge", "mmlu", "--limit", "2"]
    argv += ["--ref", "kv_cache_dtype=float32", "--test", "kv_cache_dtype=bfloat16"]
    argv += ["--resamples", "200", "--out", str(out)]
    assert main(argv + _engine_args(tiny_model_dir)) == 0
    results = _results(out)
    assert {(s["task"], s["label"]) for s in results["summary"]} == {
        (task, label)
        for task in ("arc_challenge", "mmlu", "all")
        for label in ("kv_cache_dtype=float32", "kv_cache_dtype=bfloat16")
    }
    assert len(results["samples"]) == 4
    assert (out / "accuracy_delta.png").exists()


def test_greedy_writes_its_report(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "greedy"
    argv = ["eval", "greedy", "--num-prompts", "2", "--max-tokens", "4"]
    argv += ["--test", "same:", "--out", str(out)]
    assert main(argv + _engine_args(tiny_model_dir)) == 0
    (summary,) = _results(out)["summary"]
    assert (summary["label"], summary["num_identical"], summary["num_prompts"]) == ("same", 2, 2)


@pytest.mark.parametrize("command", ["distribution", "choice", "greedy"])
def test_a_bad_format_is_one_line_and_exit_code_2(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", command, "--test", "kv_dtype=fp8", "--out", str(tmp_path / "x")]
    assert main(argv) == 2
    assert "unknown format option 'kv_dtype'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
