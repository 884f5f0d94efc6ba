"""The H200 check's driver, run as its CPU dry run (tiny shapes, Triton's interpreter) with every
package the check machine lacks made unimportable from densa's code: so scripts/gpu_check.sh
cannot rot, nor grow a dependency that machine does not have. Then its report is rendered."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from densa_bench.gpu.report import write_report

# Not importorskip: importing Triton here, before tests/gpu sets TRITON_INTERPRET, would fix its
# mode for the whole session.
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

# Installed here but not on the check machine (docs/benchmarks/gpu/README.md).
ABSENT_THERE = ("fastapi", "uvicorn", "pydantic", "starlette", "gguf", "openai", "llguidance")

# Refuses those imports when densa's own code asks for them (libraries probing for optional
# packages are left alone), then runs the driver like `python -m densa_bench.gpu.check`.
RUNNER = """
import importlib.abc, sys, runpy
ABSENT = set(sys.argv[1].split(","))

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in ABSENT:
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(
            ("importlib", "_frozen_importlib")
        ):
            frame = frame.f_back
        caller = frame.f_globals.get("__name__", "") if frame is not None else ""
        if caller.startswith("densa"):
            raise ModuleNotFoundError(f"{name} is not on the check machine ({caller} asked)")
        return None

sys.meta_path.insert(0, Absent())
sys.argv = ["gpu_check", *sys.argv[2:]]
runpy.run_module("densa_bench.gpu.check", run_name="__main__")
"""


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    command = [sys.executable, "-c", RUNNER, ",".join(ABSENT_THERE),
               "--dry-run", "--out", str(out), "--workdir", str(out / "work")]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text())


def test_dry_run_checks_every_kernel_against_its_reference(dry_run: dict) -> None:
    assert dry_run["errors"] == [] and dry_run["skipped"] == []
    checked = {c["kernel"] for c in dry_run["correctness"]}
    assert checked == {
        "decode_attention", "prefill_attention", "int4_linear_sym", "int4_linear_asym",
        "fp8_linear", "integrity_check",
    }  # fmt: skip
    assert all(c["ok"] for c in dry_run["correctness"])
    timed = {t["kernel"] for t in dry_run["kernels"]}
    assert {"decode_attention_bf16", "decode_attention_fp8", "int4_linear", "fp8_linear",
            "dense_bf16_linear", "integrity_torch", "integrity_triton"} <= timed  # fmt: skip


def test_dry_run_sweeps_every_engine_at_every_concurrency(dry_run: dict) -> None:
    e2e = dry_run["e2e"]
    cells = {(r["variant"], r["concurrency"]) for r in e2e["runs"]}
    engines = ("base", "int4", "integrity_off", "kv_bf16", "kv_fp8")
    assert cells == {(name, c) for name in engines for c in (1, 2)}
    # One KV budget in bytes: FP8 pages hold more requests than the baseline's.
    assert e2e["engines"]["kv_fp8"]["fits_requests"] > e2e["engines"]["kv_bf16"]["fits_requests"]
    assert all(r["output_tok_s"] > 0 and r["preemptions"] >= 0 for r in e2e["runs"])


def test_report_renders_the_tables_and_plots(dry_run: dict, tmp_path: Path) -> None:
    folder = write_report(dry_run, tmp_path)
    readme = (folder / "README.md").read_text()
    assert "Dry run on a CPU" in readme
    for title in ("BF16 vs FP8 KV pages", "BF16 vs INT4 (g128) weights", "integrity checks on"):
        assert title in readme
    assert "| decode_attention_fp8 |" in readme and "| int4_linear |" in readme
    pytest.importorskip("matplotlib")
    assert {p.name for p in folder.glob("*.png")} == {"kv.png", "weights.png", "integrity.png"}
