"""`densa bench tiers` end to end on a tiny random model (fast): every configuration answers with
the same tokens; with one worker the disk tier reaches the workload's ceiling where the device
pool alone hits nothing; with two workers round-robin the shared store hits more than local
disks; the report has its table, plot and JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from densa.setup.args import EngineArgs
from densa_bench.common.redis_server import INSTALL_HINT, redis_server_binary
from densa_bench.tiers.runner import run_tiers
from densa_bench.tiers.settings import TiersSettings


def test_bench_tiers_on_a_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    if redis_server_binary() is None:
        pytest.skip(INSTALL_HINT)
    settings = TiersSettings(num_sessions=4, num_turns=3, system_tokens=96, user_tokens=16,
                             max_tokens=4)  # fmt: skip
    seen = []
    environment = dict(os.environ)
    report = run_tiers(settings, EngineArgs(model=str(tiny_model_dir)), on_config=seen.append)
    # Its cluster secret stays its own: set in this process's environment, every process the
    # caller starts afterwards would inherit it (a test's `densa serve` then took the secret).
    assert dict(os.environ) == environment
    assert len(seen) == 6
    rows = {(row["variant"], row["workers"]): row for row in report.summary}
    assert all(row["outputs_identical"] for row in rows.values())
    assert rows["off", 1]["hit_rate"] == 0.0
    assert rows["disk", 1]["hit_rate"] == rows["disk", 1]["ceiling_hit_rate"] > 0.8
    assert rows["shared", 1]["share_of_ceiling"] == 1.0
    assert rows["shared", 2]["hit_rate"] > rows["disk", 2]["hit_rate"]
    paths = report.write(tmp_path)
    assert {p.name for p in paths} == {"results.json", "README.md", "ttft_per_turn.png"}
    assert "hit rate vs disk" in (tmp_path / "README.md").read_text()
    assert len(json.loads((tmp_path / "results.json").read_text())["samples"]) == 6 * 12
