"""`densa bench agent`: N coding-agent sessions (traces.py) replayed at once against each server.

Per configuration (engine x replay), a fresh server starts (so no replay is helped by another's
prefix cache), every session runs in its own thread, turn after turn: the conversation so far
with the tools and `tool_choice: required`, greedy, streamed through the openai client. Replays
interleave (A B C, A B C): the machine's drift falls on every engine alike, and replay 2 of an
engine against its replay 1 is the consistency check (the same session gives the same calls?).

Per turn it records TTFT (submit -> first streamed delta), the output and prompt tokens and the
prompt tokens the server found cached (usage.prompt_tokens_details.cached_tokens, or
llama-server's timings.cache_n), whether the call is valid (one of the tools, its arguments a
JSON object with the required keys of the right types) and whether the turn timed out.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from densa.utils.logging import get_logger
from densa_bench.agent.traces import TOOLS, Trace
from densa_bench.peers.servers import PeerServer, PeerSpec

logger = get_logger(__name__)
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict,
    "array": list,
}  # fmt: skip


@dataclass
class TurnRecord:
    session: int
    turn: int
    submit_s: float  # since the run started
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    calls: list[dict[str, Any]] = field(default_factory=list)  # [{"name", "arguments" (text)}]
    text: str = ""
    valid: bool = False
    timed_out: bool = False
    error: str | None = None

    def signature(self) -> str:
        """What consistency compares: the calls as sent, or the text and error."""
        return json.dumps([self.calls, self.text, self.error], sort_keys=True)


@dataclass
class AgentRun:
    engine: str
    replay: int
    wall_s: float
    turns: list[TurnRecord]
    load_average: tuple[float, float]


def run_sessions(
    server: PeerServer,
    traces: Sequence[Trace],
    max_tokens: int,
    timeout_s: float,
    extra_body: dict[str, Any],
) -> tuple[list[TurnRecord], float]:
    """Every session at once, one thread each; returns their turns (session, turn order)."""
    records: list[list[TurnRecord]] = [[] for _ in traces]
    started = time.perf_counter()

    def session(idx: int) -> None:
        from openai import OpenAI

        client = OpenAI(base_url=server.endpoint.base_url, api_key="unused", max_retries=0,
                        timeout=timeout_s)  # fmt: skip
        for turn in range(len(traces[idx].turns)):
            record = one_turn(
                client, server.spec.model, traces[idx], turn, max_tokens, extra_body, started,
                timeout_s,
            )  # fmt: skip
            records[idx].append(record)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(len(traces))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [r for rs in records for r in rs], time.perf_counter() - started


def one_turn(
    client: Any,
    model: str,
    trace: Trace,
    turn: int,
    max_tokens: int,
    extra_body: dict[str, Any],
    started: float,
    timeout_s: float = float("inf"),
) -> TurnRecord:
    submit = time.perf_counter()
    record = TurnRecord(trace.session, turn, submit - started)
    calls: dict[int, dict[str, str]] = {}
    try:
        stream = client.chat.completions.create(
            model=model, messages=trace.messages(turn), tools=TOOLS, tool_choice="required",
            temperature=0.0, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body=extra_body or None,
        )  # fmt: skip
        for chunk in stream:
            _read_chunk(chunk, record, calls, submit)
        record.e2e_s = time.perf_counter() - submit
        record.timed_out = record.e2e_s > timeout_s
    except Exception as exc:  # any HTTP, protocol or timeout error ends this turn only
        name = type(exc).__name__
        record.timed_out = "Timeout" in name
        record.error = f"{name}: {exc}"[:300]
    record.calls = [calls[i] for i in sorted(calls)]
    record.valid = record.error is None and is_valid(record.calls)
    return record


def _read_chunk(
    chunk: Any, record: TurnRecord, calls: dict[int, dict[str, str]], submit: float
) -> None:
    if chunk.choices:
        delta = chunk.choices[0].delta
        if (delta.content or delta.tool_calls) and record.ttft_s is None:
            record.ttft_s = time.perf_counter() - submit
        record.text += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index or 0, {"name": "", "arguments": ""})
            if call.function is not None:
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    usage = chunk.usage
    if usage is not None:
        record.prompt_tokens = usage.prompt_tokens or 0
        record.completion_tokens = usage.completion_tokens or 0
        details = getattr(usage, "prompt_tokens_details", None)
        if details is not None and details.cached_tokens is not None:
            record.cached_tokens = details.cached_tokens
    timings = (chunk.model_extra or {}).get("timings")
    if isinstance(timings, dict) and "cache_n" in timings:  # llama-server
        record.cached_tokens = int(timings["cache_n"])


def is_valid(calls: list[dict[str, str]]) -> bool:
    """One or more calls, each to a defined tool, its arguments a JSON object holding the
    tool's required keys, every known key of its declared type."""
    if not calls:
        return False
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        schema = schemas.get(call["name"])
        try:
            arguments = json.loads(call["arguments"])
        except json.JSONDecodeError:
            return False
        if schema is None or not isinstance(arguments, dict):
            return False
        if any(key not in arguments for key in schema.get("required", [])):
            return False
        for key, value in arguments.items():
            kind = schema["properties"].get(key, {}).get("type")
            if kind in _JSON_TYPES and not isinstance(value, _JSON_TYPES[kind]):
                return False
    return True


# ---- the runs -------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineConfig:
    """One engine configuration: how its server is built (per run: a disk tier needs a fresh
    directory), and the body fields its requests carry."""

    name: str
    build: Callable[[Path], PeerSpec]  # scratch directory -> spec


def run_all(
    configs: Sequence[EngineConfig],
    traces: Sequence[Trace],
    replays: int,
    max_tokens: int,
    timeout_s: float,
    log_dir: Path,
    on_run: Callable[[list[AgentRun]], None] | None = None,
) -> list[AgentRun]:
    """Replay after replay, engine after engine, each on a fresh server."""
    import os

    runs: list[AgentRun] = []
    for replay in range(replays):
        for config in configs:
            scratch = Path(tempfile.mkdtemp(prefix="densa-agent-"))
            try:
                spec = dataclasses.replace(config.build(scratch), name=config.name)
                server = PeerServer(spec, log_dir / f"replay{replay}")
                logger.info("starting %s (replay %d)", config.name, replay + 1)
                load_before = os.getloadavg()[0]
                with server:
                    turns, wall = run_sessions(server, traces, max_tokens, timeout_s,
                                               spec.extra_body)  # fmt: skip
                runs.append(AgentRun(config.name, replay, wall, turns,
                                     (load_before, os.getloadavg()[0])))  # fmt: skip
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            valid = sum(t.valid for t in turns)
            logger.info("%s replay %d: %d/%d valid calls in %.0f s", config.name, replay + 1,
                        valid, len(turns), wall)  # fmt: skip
            if on_run is not None:
                on_run(runs)
    return runs
