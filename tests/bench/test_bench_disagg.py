"""`densa bench disagg`: its command line, its statistics and report (the run itself starts five
engine processes and is a benchmark, run by hand: docs/benchmarks/disagg/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from densa.cli import build_parser, main
from densa.setup.args import EngineArgs
from densa_bench.disagg.report import build_report
from densa_bench.disagg.runner import RequestResult, Variant, _sample
from densa_bench.disagg.settings import DisaggSettings


def test_bench_parser_routes_to_disagg() -> None:
    ns = build_parser().parse_args(["bench", "disagg", "--num-long", "2", "--repeats", "1"])
    assert ns.num_long == 2 and ns.repeats == 1 and ns.kv_cache_memory == "1GiB"
    assert ns.benchmark == "disagg"


def test_bad_settings_get_a_clear_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "disagg", "--num-decoders", "0"]) == 2
    assert "--num-decoders must be >= 1" in capsys.readouterr().err


def _result(kind: str, submit: float, events: list[float]) -> RequestResult:
    return RequestResult(kind, submit, events, len(events))


def test_samples_measure_itl_ttft_and_per_transfer_costs(tmp_path: Path) -> None:
    results = [
        _result("decoder", 0.0, [0.1, 0.2, 0.5]),  # gaps 0.1 and 0.3
        _result("decoder", 0.0, [0.2, 0.3]),  # gap 0.1
        _result("long", 1.0, [1.4]),
    ]
    before = {"transfers_landed": 1.0, "bytes": 100.0, "transfer_ms": 5.0, "landing_ms": 1.0}
    after = {"transfers_landed": 4.0, "bytes": 700.0, "transfer_ms": 35.0, "landing_ms": 4.0}
    sample = _sample(Variant("split-same", True), 0, results, 2.0, before, after)
    assert sample["decode_itl_s"]["median"] == pytest.approx(0.1)
    assert sample["decode_itl_s"]["max"] == pytest.approx(0.3)
    assert sample["ttft_s"]["median"] == pytest.approx(0.2)
    assert sample["long_ttft_s"]["median"] == pytest.approx(0.4)
    assert sample["output_tok_s"] == pytest.approx(6 / 2.0)
    assert sample["transfer_bytes_per_request"] == pytest.approx(200.0)
    assert sample["transfer_ms_per_request"] == pytest.approx(10.0)
    assert sample["landing_ms_per_request"] == pytest.approx(1.0)
    report = build_report(DisaggSettings(repeats=1), [sample], EngineArgs())
    paths = report.write(tmp_path)
    assert {p.name for p in paths} == {"results.json", "decode_itl.png", "README.md"}
    assert "| split-same | 0 (0..0) | 10.0 (10.0..10.0)" in (tmp_path / "README.md").read_text()


def test_the_link_authentication_is_reported_as_a_share_of_transfer_time() -> None:
    results = [_result("decoder", 0.0, [0.1, 0.2])]
    before = {"transfers_landed": 0.0, "transfer_ms": 0.0, "mac_ms": 0.0}
    after = {"transfers_landed": 2.0, "transfer_ms": 100.0, "mac_ms": 0.6}
    sample = _sample(Variant("split-same", True), 0, results, 1.0, before, after, 0.4)
    assert sample["mac_ms_per_request"] == pytest.approx(0.5)  # (0.6 D + 0.4 P) / 2 transfers
    report = build_report(DisaggSettings(repeats=1), [sample], EngineArgs())
    (row,) = report.summary
    assert row["mac_share_of_transfer"]["median"] == pytest.approx(0.01)
    assert "1.00 (1.00..1.00) %" in report.tables[1].rows[0]
