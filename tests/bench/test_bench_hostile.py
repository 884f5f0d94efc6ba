"""`densa bench hostile` on the tiny model: oversized prompts are refused, and the report says so."""

from __future__ import annotations

from pathlib import Path

from densa.setup.args import EngineArgs
from densa_bench.hostile.runner import run_hostile_bench
from densa_bench.hostile.settings import HostileSettings


def test_hostile_bench_reports_refusals_and_latency(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = HostileSettings(
        num_hostile=1, hostile_bytes=300_000, requests_per_phase=2, repeats=1, max_tokens=2
    )
    args = EngineArgs(model=str(tiny_model_dir), kv_cache_memory="32MiB", max_model_len=256)
    report = run_hostile_bench(settings, args)
    summary = report.summary[0]
    assert set(summary["hostile_statuses"]) == {"400"}  # every oversized prompt refused
    assert summary["hostile_statuses"]["400"] >= 1
    assert summary["median_ratio"] > 0
    assert [s["phase"] for s in report.samples] == ["quiet", "quiet", "hostile", "hostile"]
    paths = report.write(tmp_path)
    assert (tmp_path / "README.md") in paths
    assert "hostile / quiet" in (tmp_path / "README.md").read_text()
