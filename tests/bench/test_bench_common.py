"""The benchmark harness: statistics, interleaving, timing arithmetic, report files, and a smoke run
of `densa bench serving` (densa and transformers) on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from densa.cli import build_parser, main
from densa_bench.cli import BENCHMARKS
from densa_bench.common.benchmark import settings_from
from densa_bench.common.hardware import PeakRSS
from densa_bench.common.report import BenchReport, LinePlot, Series, Table
from densa_bench.common.stats import (
    format_spread,
    interleave,
    latency_stats,
    median,
    percentile,
    spread,
)
from densa_bench.common.timing import RequestTiming
from densa_bench.serving.runner import FIRST_PROMPT_TOKEN_ID, make_prompts
from densa_bench.serving.settings import ServingSettings

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---- statistics ------------------------------------------------------------------------------
def test_percentiles_interpolate_linearly_like_numpy() -> None:
    values = [float(v) for v in range(10, 0, -1)]  # 10..1, unsorted on purpose
    assert median(values) == pytest.approx(5.5)
    assert percentile(values, 95) == pytest.approx(9.55)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 10.0
    assert median([3.0]) == 3.0


def test_percentile_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_latency_stats_and_spread() -> None:
    stats = latency_stats([0.1, 0.2, 0.3, 0.4])
    assert stats == pytest.approx(
        {"median": 0.25, "p95": 0.385, "p99": 0.397, "mean": 0.25, "min": 0.1, "max": 0.4,
         "count": 4}
    )  # fmt: skip
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert format_spread({"median": 2.0, "min": 1.0, "max": 3.25}) == "2.0 (1.0..3.2)"


def test_interleave_runs_every_variant_once_per_repetition() -> None:
    assert interleave(["A", "B"], 3) == [
        (0, "A"), (0, "B"), (1, "A"), (1, "B"), (2, "A"), (2, "B"),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="repeats"):
        interleave(["A"], 0)


def test_request_timing_arithmetic() -> None:
    timing = RequestTiming(submit_s=10.0, token_s=[10.5, 10.7, 11.0, 11.1])
    assert timing.ttft_s == pytest.approx(0.5)
    assert timing.e2e_s == pytest.approx(1.1)
    assert timing.tpot_s == pytest.approx(0.6 / 3)
    assert timing.itl_s == pytest.approx([0.2, 0.3, 0.1])
    assert RequestTiming(submit_s=0.0, token_s=[1.0]).tpot_s is None


def test_peak_rss_covers_memory_touched_after_start() -> None:
    rss = PeakRSS()
    rss.start()
    block = bytearray(64 * 1024 * 1024)  # zero-filled, so every page is touched
    assert rss.peak_bytes() >= rss.start_bytes + len(block) // 2
    del block


def test_prompts_are_reproducible_distinct_and_plain() -> None:
    settings = ServingSettings(prompt_len=32, prompt_seed=7)
    first = make_prompts(settings, vocab_size=1000, count=4, wave_key="c4-r0")
    assert first == make_prompts(settings, vocab_size=1000, count=4, wave_key="c4-r0")
    assert first != make_prompts(settings, vocab_size=1000, count=4, wave_key="c4-r1")
    assert len({tuple(p[:16]) for p in first}) == 4  # no shared first page
    assert all(len(p) == 32 and min(p) >= FIRST_PROMPT_TOKEN_ID and max(p) < 1000 for p in first)


# ---- report files ----------------------------------------------------------------------------
def test_report_writes_json_markdown_and_png(tmp_path: Path) -> None:
    report = BenchReport(
        name="demo",
        settings={"repeats": 2, "engine": {"dtype": "float32"}},
        samples=[{"engine": "a", "value": 1.0}],
        summary=[{"engine": "a", "value": {"median": 1.0, "min": 1.0, "max": 1.0}}],
        tables=[Table("Results", ["engine", "value"], [["a", "1.0"], ["b|c", "2.0"]])],
        plots=[LinePlot("speed", "Speed", "concurrency", "tok/s", [Series("a", [1, 8], [2, 9])])],
        notes=["a note"],
        command="densa bench demo --repeats 2",
    )
    paths = report.write(tmp_path / "out")
    assert sorted(p.name for p in paths) == ["README.md", "results.json", "speed.png"]

    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(data) == {
        "name", "command", "date", "hardware", "settings", "summary", "samples", "notes",
    }  # fmt: skip
    assert data["command"] == "densa bench demo --repeats 2"
    assert {"cpu_model", "torch_threads", "torch", "gpu"} <= set(data["hardware"])

    markdown = (tmp_path / "out" / "README.md").read_text()
    assert "densa bench demo --repeats 2" in markdown
    assert "| engine.dtype | float32 |" in markdown  # nested settings are flattened
    assert "| b\\|c | 2.0 |" in markdown  # a pipe in a cell does not split the row
    assert "![Speed](speed.png)" in markdown
    assert (tmp_path / "out" / "speed.png").read_bytes().startswith(PNG_SIGNATURE)


# ---- the command line ------------------------------------------------------------------------
def test_bench_parser_routes_to_serving() -> None:
    ns = build_parser().parse_args(["bench", "serving", "--concurrency", "2", "4", "--skip-hf"])
    assert ns.concurrency == [2, 4] and ns.skip_hf
    assert ns.kv_cache_memory == "2GiB"  # a fixed budget, not a fraction of free memory
    assert ns.benchmark == "serving"


def test_bench_without_a_benchmark_prints_help() -> None:
    assert main(["bench"]) == 2


def test_bad_settings_get_a_clear_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serving", "--concurrency", "0"]) == 2
    assert "concurrency levels must be >= 1" in capsys.readouterr().err


def test_serving_smoke_run(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_dir = tmp_path / "serving"
    argv = ["bench", "serving", "--model", str(tiny_model_dir), "--kv-cache-memory", "16MiB",
            "--concurrency", "1", "2", "--prompt-len", "16", "--output-len", "4",
            "--repeats", "1", "--out", str(out_dir)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["densa", *argv])
    assert main(argv) == 0

    data = json.loads((out_dir / "results.json").read_text())
    assert data["command"].startswith("densa bench serving --model")
    order = [(s["engine"], s["concurrency"]) for s in data["samples"]]
    assert order == [("densa", 1), ("hf", 1), ("densa", 2), ("hf", 2)]  # interleaved
    for sample in data["samples"]:
        assert sample["num_output_tokens"] == 4 * sample["concurrency"]
        assert len(sample["ttft_s"]) == len(sample["tpot_s"]) == sample["concurrency"]
        assert sample["num_cached_tokens"] == 0
    ratios = [row for row in data["summary"] if row["kind"] == "ratio"]
    assert [row["concurrency"] for row in ratios] == [1, 2]
    engines = [row for row in data["summary"] if row["kind"] == "engine"]
    assert all(row["ttft_s"]["p95"] > 0 and row["peak_rss_bytes"] > 0 for row in engines)

    markdown = (out_dir / "README.md").read_text()
    assert "densa / HF output tokens/s" in markdown and "| cpu_model |" in markdown
    for name in ("output_tok_s", "ttft_s", "tpot_s"):
        assert (out_dir / f"{name}.png").read_bytes().startswith(PNG_SIGNATURE)


def test_serving_measures_the_deterministic_mode_beside_the_default(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_dir = tmp_path / "deterministic"
    argv = ["bench", "serving", "--model", str(tiny_model_dir), "--kv-cache-memory", "16MiB",
            "--concurrency", "2", "--prompt-len", "40", "--output-len", "4", "--repeats", "2",
            "--warmup", "0", "--skip-hf", "--deterministic-pair", "--out", str(out_dir)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["densa", *argv])
    assert main(argv) == 0
    data = json.loads((out_dir / "results.json").read_text())
    order = [(s["engine"], s["repeat_idx"]) for s in data["samples"]]
    assert order == [("densa", 0), ("densa-deterministic", 0), ("densa", 1),
                     ("densa-deterministic", 1)]  # fmt: skip
    [ratio] = [row for row in data["summary"] if row["kind"] == "ratio"]
    assert ratio["deterministic_over_default_output_tok_s"]["median"] > 0
    assert "densa --deterministic / densa output tokens/s" in (out_dir / "README.md").read_text()


def test_a_servers_peak_rss_includes_its_child_processes(tmp_path: Path) -> None:
    """densa serves from two processes (HTTP front, engine): the figure covers both."""
    import subprocess
    import sys
    import time

    from densa_bench.peers.servers import PeerServer, PeerSpec

    child = (
        "import time; b = bytearray(96 * 1024 * 1024); print('ready', flush=True); time.sleep(60)"
    )
    parent = (
        "import subprocess, sys, time; "
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE); "
        "p.stdout.readline(); print('ready', flush=True); time.sleep(60)"
    )
    server = PeerServer(PeerSpec("tree", "fake", (), "m"), tmp_path)
    server.process = subprocess.Popen(
        [sys.executable, "-c", parent], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert server.process.stdout is not None
        assert server.process.stdout.readline().strip() == b"ready"
        time.sleep(0.1)
        assert len(server.process_ids()) == 2
        assert server.peak_rss_bytes() >= 96 * 1024 * 1024
        assert server.reset_peak_rss() >= 96 * 1024 * 1024
    finally:
        server.stop(grace_s=5)


def test_every_benchmark_s_default_options_give_its_default_settings() -> None:
    """The options are generated from the settings dataclass: parsing no option at all gives
    the dataclass's own defaults, and a flag reaches its field (even a negated one)."""
    parser = build_parser()
    for benchmark in BENCHMARKS:
        ns = parser.parse_args(["bench", benchmark.name])
        assert settings_from(ns, benchmark.settings) == benchmark.settings(), benchmark.name
    ns = parser.parse_args(["bench", "serving", "--skip-hf", "--prompt-len", "7"])
    settings = settings_from(ns, ServingSettings)
    assert not settings.include_hf and settings.prompt_len == 7


def test_building_the_bench_parser_imports_no_torch() -> None:
    """Every benchmark's options come from its settings.py, which imports no torch: `densa
    --help` and the parser stay fast; a runner loads only when its benchmark runs."""
    script = (
        "import sys\nfrom densa.cli import build_parser\nbuild_parser()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr[-2000:]
