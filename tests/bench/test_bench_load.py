"""`densa bench load` end to end on the tiny model, and the account it keeps catching real faults."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from densa.cli import main
from densa.serve.scrape import MetricSamples
from densa_bench.load.runner import (
    ClientPlan,
    ClientResult,
    LoadRun,
    LoadSettings,
    find_problems,
    plan_clients,
)


def test_load_smoke_run(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_dir = tmp_path / "load"
    argv = ["bench", "load", "--model", str(tiny_model_dir), "--kv-cache-memory", "16MiB",
            "--max-model-len", "256", "--clients", "12", "--prompt-lens", "20", "60",
            "--shared-prefix-len", "16", "--max-tokens", "4", "--long-max-tokens", "100",
            "--time-limit", "60", "--out", str(out_dir)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["densa", *argv])
    assert main(argv) == 0
    data = json.loads((out_dir / "results.json").read_text())
    [summary] = data["summary"]
    assert summary["problems"] == []
    assert summary["outcomes_client"] == summary["outcomes_server"]
    assert len(data["samples"]) == 12
    assert "nothing lost" in (out_dir / "README.md").read_text()
    assert (out_dir / "ttft_by_prompt_len.png").stat().st_size > 0


def test_plan_mixes_behaviours_and_shares_a_prefix() -> None:
    settings = LoadSettings(num_clients=20, prompt_lens=(30, 50), shared_prefix_len=16)
    plans = plan_clients(settings)
    behaviours = [p.behaviour for p in plans]
    assert behaviours.count("disconnect") == behaviours.count("cancel") == 3
    assert {len(p.prompt) for p in plans} == {30, 50}
    assert len({tuple(p.prompt[:16]) for p in plans[::2]}) == 1
    assert all(p.max_tokens == settings.long_max_tokens for p in plans if p.behaviour != "complete")
    with pytest.raises(ValueError):
        LoadSettings(prompt_lens=(8,), shared_prefix_len=8)


def _metrics(
    requests: dict[str, int], pages_free: int = 10, prompt_tokens: int = 0
) -> MetricSamples:
    lines = [f'densa_requests_total{{outcome="{o}",status="200"}} {n}' for o, n in requests.items()]
    lines += [
        f"densa_prompt_tokens_total {prompt_tokens}",
        f"densa_generation_tokens_total {3 * sum(requests.values())}",
        f"densa_time_to_first_token_seconds_count {sum(requests.values())}",
        f"densa_e2e_request_latency_seconds_count {sum(requests.values())}",
        "densa_kv_pages_total 10",
        f"densa_kv_pages_free {pages_free}",
    ]
    return MetricSamples("\n".join(lines) + "\n")


def _complete_client() -> ClientResult:
    plan = ClientPlan(0, "complete", [1, 2, 3, 4, 5], 3, 1, 0.0)
    result = ClientResult(plan, status=200, finish_reason="length", has_usage=True, has_done=True)
    result.completion_tokens, result.num_events = 3, 3
    result.conclude()
    return result


def test_the_account_holds_for_a_clean_run() -> None:
    after = _metrics({"length": 1}, prompt_tokens=5)
    run = LoadRun(LoadSettings(), [_complete_client()], _metrics({}), after, 1.0)
    assert find_problems(run) == []


def test_the_account_catches_leaks_losses_and_miscounts() -> None:
    lost = ClientResult(ClientPlan(1, "complete", [7], 3, 1, 0.0), status=200)
    lost.conclude()  # a stream that ended without [DONE]
    before = _metrics({})
    after = _metrics({"length": 2}, pages_free=9, prompt_tokens=6)
    problems = find_problems(LoadRun(LoadSettings(), [_complete_client(), lost], before, after, 1))
    text = "\n".join(problems)
    assert "client 1 (complete): no complete answer" in text
    assert "requests by outcome" in text
    assert "KV pages leaked: 9 of 10 free" in text
