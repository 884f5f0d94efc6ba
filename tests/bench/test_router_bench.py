"""`densa bench router`'s arithmetic on hand-made runs (the benchmark itself needs three
workers and minutes; its numbers are in docs/benchmarks/router/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from densa_bench.router.runner import (
    POLICIES,
    RouterBenchSettings,
    build_report,
    summarize_run,
    system_prompt,
    user_message,
)


def request(worker: str, ttft: float, prompt: int, cached: int, turn: int = 0) -> dict[str, object]:
    return {"worker": worker, "ttft_s": ttft, "prompt_tokens": prompt, "cached_tokens": cached,
            "output_tokens": 10, "router_ms": 0.5, "turn": turn}  # fmt: skip


def test_a_run_summary_weighs_hit_rate_by_tokens_and_counts_output_over_wall_time() -> None:
    run = {"wall_s": 4.0, "requests": [request("a", 0.1, 100, 0), request("b", 0.3, 300, 240),
                                       request("a", 0.2, 100, 80, turn=1)]}  # fmt: skip
    summary = summarize_run(run)
    assert summary["hit_rate"] == pytest.approx(320 / 500)
    assert summary["ttft_p50_s"] == pytest.approx(0.2)
    assert summary["output_tok_s"] == pytest.approx(30 / 4.0)
    assert summary["requests_per_worker"] == [1, 2]


def test_the_report_states_each_goal_and_whether_it_was_met(tmp_path: Path) -> None:
    hit = {"round-robin": 0.3, "least-load": 0.35, "prefix": 0.8, "densa": 0.75}
    p95 = {"round-robin": 3.0, "least-load": 2.5, "prefix": 2.2, "densa": 1.9}
    samples = []
    for repeat_idx in range(2):
        for policy in POLICIES:
            run = {"wall_s": 10.0, "requests": [
                request("a", p95[policy], 1000, int(hit[policy] * 1000))]}  # fmt: skip
            samples.append({"policy": policy, "repeat_idx": repeat_idx, **summarize_run(run),
                            "requests": run["requests"]})  # fmt: skip
    latency = {"direct_ms": 10.0, "routed_ms": 11.5, "added_ms_p50": 1.5}
    report = build_report(RouterBenchSettings(), samples, latency)
    assert report.notes[0].startswith("Hit rate: densa 75.0% vs round-robin 30.0% = 2.50x")
    assert report.notes[0].endswith("met).") and "NOT" not in report.notes[0]
    assert "densa 1900 ms" in report.notes[1] and "NOT" not in report.notes[1]
    assert "1.50 ms longer" in report.notes[2]
    paths = report.write(tmp_path)
    assert {p.name for p in paths} == {"results.json", "README.md", "ttft_by_turn.png"}


def test_prompts_differ_per_run_so_no_run_hits_another_runs_cache() -> None:
    assert system_prompt(0, "densa-0", 100) != system_prompt(0, "prefix-0", 100)
    assert system_prompt(0, "densa-0", 100) != system_prompt(1, "densa-0", 100)
    assert user_message(0, 1, 2, "densa-0", 60) != user_message(0, 1, 3, "densa-0", 60)
    with pytest.raises(ValueError):
        RouterBenchSettings(tenant_sessions=())
