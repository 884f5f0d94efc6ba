"""`densa bench kv-sweep` end to end on the tiny model: one budget for both KV dtypes, waves
interleaved, FP8 admitting more requests than BF16 once BF16 runs out of pages."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from densa.cli import main
from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig
from densa.model.kv_pages import page_bytes
from densa_bench.kv_sweep.runner import kv_budget_bytes
from densa_bench.kv_sweep.settings import KVSweepSettings


def test_budget_holds_the_asked_bf16_requests(tiny_model_dir: Path) -> None:
    arch = ArchConfig.from_dir(tiny_model_dir)
    settings = KVSweepSettings(prompt_len=30, output_len=10, budget_requests=2.5)
    budget = kv_budget_bytes(arch, settings, page_size=4)
    assert budget == int(
        2.5 * 10 * page_bytes(arch, 4, KVFormat.of("bfloat16"))
    )  # 40 tokens = 10 pages
    with pytest.raises(ValueError):
        KVSweepSettings(budget_requests=0.5)
    with pytest.raises(ValueError):
        KVSweepSettings(kv_dtypes=("bfloat16", "bfloat16"))


def test_kv_sweep_smoke_run(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_dir = tmp_path / "kv_sweep"
    argv = ["bench", "kv-sweep", "--model", str(tiny_model_dir), "--concurrency", "1", "6",
            "--prompt-len", "30", "--output-len", "6", "--budget-requests", "2.5",
            "--page-size", "4", "--repeats", "2", "--out", str(out_dir)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["densa", *argv])
    assert main(argv) == 0
    data = json.loads((out_dir / "results.json").read_text())
    order = [(s["engine"], s["concurrency"]) for s in data["samples"]]
    assert order == [("bfloat16", 1), ("fp8_e4m3", 1), ("bfloat16", 6), ("fp8_e4m3", 6)] * 2
    capacity = data["settings"]["capacity"]
    # 36 tokens = 9 pages per request; 2.5 BF16 requests = 22 pages of 4 BF16 tokens (1024 B);
    # the same 23040 bytes hold 42 FP8 pages (544 B: 128 values + 8 exponent bytes per token).
    assert capacity["bfloat16"]["kv_pages"] == 22 and capacity["bfloat16"]["requests_that_fit"] == 2
    assert capacity["fp8_e4m3"]["kv_pages"] == 42 and capacity["fp8_e4m3"]["requests_that_fit"] == 4
    points = {(r["engine"], r["concurrency"]): r for r in data["summary"] if r["kind"] == "point"}
    assert points[("fp8_e4m3", 6)]["peak_running"] > points[("bfloat16", 6)]["peak_running"]
    for row in points.values():
        assert row["output_tok_s"]["median"] > 0 and 0 < row["prefill_share"]["median"] < 1
        assert row["tpot_s"]["p95"] >= row["tpot_s"]["median"] > 0
    headline = [r for r in data["summary"] if r["kind"] == "headline"]
    assert [h["engine"] for h in headline] == ["fp8_e4m3"] and headline[0]["baseline"] == "bfloat16"
    assert (out_dir / "output_tok_s.png").stat().st_size > 0
    readme = (out_dir / "README.md").read_text()
    assert "What the fixed KV budget holds" in readme and "per-request slowdown" in readme
