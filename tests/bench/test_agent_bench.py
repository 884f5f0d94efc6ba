"""`densa bench agent`: the committed traces, reading a streamed turn (tool-call deltas, usage,
cached tokens as densa and llama-server report them), call validity, and the report's signals
(prefix hits and their ceiling, replay consistency, the goals)."""

from __future__ import annotations

import json
from types import SimpleNamespace as NS
from typing import Any

import pytest

from densa_bench.agent.report import build_report, summarize
from densa_bench.agent.runner import AgentRun, TurnRecord, is_valid, one_turn
from densa_bench.agent.traces import MAX_RESULT, MIN_RESULT, TOOLS, TRACES_DIR, load_traces


def test_the_committed_traces_are_agent_sessions() -> None:
    traces = load_traces(8)
    assert len({t.system for t in traces}) == 1  # one agent: the system prompt is shared
    for trace in traces:
        assert 10 <= len(trace.turns) <= 20
        assert all(is_valid([_call(turn.call)]) for turn in trace.turns)
        messages = trace.messages(3)
        assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "tool"] * 3
        assert messages[-1]["content"] == trace.turns[2].result
    for path in sorted(TRACES_DIR.glob("session_*.json")):
        sizes = json.loads(path.read_text())["result_tokens"]
        assert all(MIN_RESULT <= n <= MAX_RESULT for n in sizes), path


def _call(call: dict[str, Any]) -> dict[str, str]:
    return {"name": call["name"], "arguments": json.dumps(call["arguments"])}


def test_validity_checks_the_tool_its_required_keys_and_types() -> None:
    assert is_valid([{"name": "read_file", "arguments": '{"path": "a.py", "start_line": 3}'}])
    assert not is_valid([])
    assert not is_valid([{"name": "rm_rf", "arguments": "{}"}])
    assert not is_valid([{"name": "read_file", "arguments": '{"start_line": 3}'}])  # no path
    assert not is_valid([{"name": "read_file", "arguments": '{"path": 3}'}])  # wrong type
    assert not is_valid([{"name": "read_file", "arguments": '{"path": "a.py"'}])  # cut short


def _chunk(tool: tuple[str, str] | None = None, usage: Any = None, timings: Any = None) -> NS:
    call = NS(index=0, function=NS(name=tool[0], arguments=tool[1])) if tool else None
    choices = [NS(delta=NS(content=None, tool_calls=[call] if call else None))]
    return NS(choices=choices if tool else [], usage=usage,
              model_extra={"timings": timings} if timings else {})  # fmt: skip


class _Client:
    def __init__(self, chunks: list[NS]) -> None:
        self.chunks, self.asked = chunks, {}
        self.chat = NS(completions=NS(create=self._create))

    def _create(self, **body: Any) -> list[NS]:
        self.asked = body
        return self.chunks


@pytest.mark.parametrize("server", ["densa", "llama.cpp"])
def test_a_streamed_turn_is_read_into_its_call_and_usage(server: str) -> None:
    usage = NS(
        prompt_tokens=3000,
        completion_tokens=20,
        prompt_tokens_details=NS(cached_tokens=2800) if server == "densa" else None,
    )
    timings = {"cache_n": 2800, "prompt_n": 200} if server == "llama.cpp" else None
    client = _Client([_chunk(("read_", '{"path": ')), _chunk(("file", '"a.py"}')),
                      _chunk(usage=usage, timings=timings)])  # fmt: skip
    trace = load_traces(1)[0]
    record = one_turn(client, "m", trace, 2, 64, {}, 0.0)
    assert client.asked["tool_choice"] == "required" and client.asked["tools"] == TOOLS
    assert client.asked["messages"] == trace.messages(2) and client.asked["temperature"] == 0
    assert record.calls == [{"name": "read_file", "arguments": '{"path": "a.py"}'}]
    assert record.valid and not record.timed_out and record.ttft_s is not None
    assert (record.prompt_tokens, record.cached_tokens, record.completion_tokens) == (
        3000,
        2800,
        20,
    )


def test_a_turn_that_times_out_is_counted_not_raised() -> None:
    class Slow(_Client):
        def _create(self, **body: Any) -> list[NS]:
            raise TimeoutError("read timed out")

    record = one_turn(Slow([]), "m", load_traces(1)[0], 0, 64, {}, 0.0)
    assert record.timed_out and not record.valid and "TimeoutError" in (record.error or "")


def _run(engine: str, replay: int, calls: list[str], ttft: float) -> AgentRun:
    turns = [
        TurnRecord(
            0,
            n,
            0.0,
            ttft_s=ttft,
            prompt_tokens=1000 * (n + 1),
            cached_tokens=900 * n,
            completion_tokens=10,
            valid=True,
            calls=[{"name": "read_file", "arguments": args}],
        )
        for n, args in enumerate(calls)
    ]
    return AgentRun(engine, replay, 10.0, turns, (1.0, 1.0))


def test_the_report_has_hits_consistency_and_the_goals() -> None:
    runs = [
        _run("densa", 0, ["a", "b", "c"], 0.2), _run("llama.cpp", 0, ["a", "b", "c"], 1.0),
        _run("densa", 1, ["a", "b", "x"], 0.2), _run("llama.cpp", 1, ["a", "b", "c"], 1.0),
    ]  # fmt: skip
    row = summarize("densa", [runs[0], runs[2]])
    assert row["consistency"] == pytest.approx(2 / 3)
    assert row["prefix_hit_share"] == pytest.approx(2700 / 6000)
    assert row["prefix_hit_ceiling"] == pytest.approx(3000 / 6000)  # turn n's prefix: turn n-1
    assert row["output_tok_s"] == pytest.approx(3.0)
    report = build_report(runs, {"what": "test"})
    goals = {g["goal"]: g for g in report.summary if g.get("kind") == "goal"}
    assert goals["turn TTFT p95 vs llama.cpp"]["met"]  # 0.2 s vs 1.0 s
    assert goals["valid tool calls"]["met"] and goals["timeouts"]["met"]
