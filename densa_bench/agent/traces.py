"""The coding-agent sessions `densa bench agent` replays: deterministic synthetic traces.

A trace is what a coding agent's conversation looks like to the server: one system prompt all
sessions share (agent instructions plus five tool definitions, ~2.5k tokens once the chat
template renders the tools), a task, then turns. Turn t sends the conversation so far and asks
for a tool call (`tool_choice: required`); whatever the model answers, the trace then appends
its own scripted call and that call's result (500-2,000 tokens of real repository text: file
excerpts, search hits, test output, directory listings), so every engine and every replay sees
exactly the same prompts and the measurement compares servers, not the paths models took.

Traces are generated once from the densa repository at a pinned commit (`git show`, so the
text never drifts with the working tree) and committed as JSON under traces/:

    python -m densa_bench.agent.traces --model qwen2.5-coder-1.5b     # rewrites traces/*.json
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TRACES_DIR = Path(__file__).with_name("traces")
REPO = Path(__file__).resolve().parents[2]
SOURCE_COMMIT = "0dc5927"  # the repository text the tool results quote
NUM_SESSIONS = 8

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read lines of a file in the repository.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "repository-relative path"},
            "start_line": {"type": "integer", "description": "first line, 1-based"},
            "end_line": {"type": "integer", "description": "last line, inclusive"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "search_code", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"},
            "path": {"type": "string", "description": "a folder to search under"}},
            "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run pytest on a test file or node id.",
        "parameters": {"type": "object", "properties": {
            "target": {"type": "string"}}, "required": ["target"]}}},
    {"type": "function", "function": {
        "name": "list_directory", "description": "List a folder with each file's summary line.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "edit_file", "description": "Replace one exact snippet of a file.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "old_text": {"type": "string"},
            "new_text": {"type": "string"}}, "required": ["path", "old_text", "new_text"]}}},
]  # fmt: skip

TASKS = [
    "A request with a very long prompt is rejected with a confusing message. Find where prompt "
    "length is checked and make the error say the limit and the prompt's length.",
    "The KV page pool sometimes reports fewer free pages than it has. Find the bookkeeping and "
    "fix it, with a test.",
    "Decode attention is slow at long contexts. Find the kernel and its split-K logic and "
    "explain how a 32k context is split across threads.",
    "Add a `--max-prompt-tokens` option that rejects prompts above it. Find where options are "
    "declared and where requests are validated.",
    "The tool-call parser fails on arguments that contain a nested JSON object. Find the parser "
    "and its tests and fix it.",
    "Prefix-cache hits are not reported in the usage of streamed responses. Find where usage is "
    "built and add cached_tokens.",
    "The integrity checker's error names the wrong page. Find where mismatches are reported "
    "and fix the message, with a test.",
    "Make the scheduler log how many requests it preempted per step at debug level. Find the "
    "scheduler's step and add it.",
]


@dataclass(frozen=True)
class Turn:
    call: dict[str, Any]  # the scripted call: {"name": ..., "arguments": {...}}
    result: str  # the tool's output, appended after the call


@dataclass(frozen=True)
class Trace:
    session: int
    system: str
    task: str
    turns: list[Turn]  # turn t's request carries turns[:t] as history

    def messages(self, num_done: int) -> list[dict[str, Any]]:
        """The conversation a request for turn `num_done` sends (its first num_done turns)."""
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self.task},
        ]
        for idx, turn in enumerate(self.turns[:num_done]):
            call_id = f"call_{self.session}_{idx}"
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {
                                "name": turn.call["name"],
                                "arguments": json.dumps(turn.call["arguments"]),
                            },
                        }
                    ],
                }
            )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": turn.result})
        return messages  # fmt: skip


def load_traces(num_sessions: int, directory: Path = TRACES_DIR) -> list[Trace]:
    paths = sorted(directory.glob("session_*.json"))[:num_sessions]
    if len(paths) < num_sessions:
        raise ValueError(f"{directory} holds {len(paths)} traces; {num_sessions} asked for")
    traces = []
    for path in paths:
        data = json.loads(path.read_text())
        turns = [Turn(t["call"], t["result"]) for t in data["turns"]]
        traces.append(Trace(data["session"], data["system"], data["task"], turns))
    return traces


# ---- generation -------------------------------------------------------------------------------
class Repo:
    """The repository's text at SOURCE_COMMIT."""

    def __init__(self) -> None:
        listing = _git("ls-tree", "-r", "--name-only", SOURCE_COMMIT)
        self.files = [p for p in listing.splitlines() if p.endswith((".py", ".md", ".cpp"))]
        self._cache: dict[str, list[str]] = {}

    def lines(self, path: str) -> list[str]:
        if path not in self._cache:
            self._cache[path] = _git("show", f"{SOURCE_COMMIT}:{path}").splitlines()
        return self._cache[path]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip


def system_prompt(repo: Repo, count_tokens: Callable[[str], int], target: int = 2100) -> str:
    """Agent instructions: how to work, then project notes (docs/architecture.md) to ~target
    tokens; the chat template adds the tool definitions (~400 tokens) on top."""
    text = (
        "You are a coding agent working in the densa repository, a Python LLM inference server. "
        "Work in small steps: look before you change anything, call exactly one tool per turn, "
        "and keep edits minimal. Always answer with a tool call.\n\nProject notes:\n"
    )
    for line in repo.lines("docs/architecture.md"):
        if count_tokens(text) > target:
            break
        text += line + "\n"
    return text


def _excerpt(lines: list[str], start: int, tokens: int, count: Callable[[str], int]) -> int:
    """The end line (exclusive) of an excerpt from `start` of about `tokens` tokens."""
    end, total = start, 0
    while end < len(lines) and total < tokens:
        total += count(lines[end] + "\n")
        end += 1
    return end


MIN_RESULT, MAX_RESULT = 500, 2000  # tokens of a tool result


def make_turn(repo: Repo, rng: random.Random, count: Callable[[str], int]) -> Turn:
    """One scripted call and a result of 500-2,000 tokens (drawn until one fits)."""
    while True:
        turn = _draw_turn(repo, rng, count)
        if MIN_RESULT <= count(turn.result) <= MAX_RESULT:
            return turn


def _draw_turn(repo: Repo, rng: random.Random, count: Callable[[str], int]) -> Turn:
    """A call of a kind drawn from five, its result aimed at 500-1,500 tokens."""
    tokens = rng.randrange(MIN_RESULT, 1500)
    kind = rng.choice(["read_file", "read_file", "search_code", "run_tests", "list_directory"])
    path = rng.choice([p for p in repo.files if p.endswith(".py")])
    lines = repo.lines(path)
    if kind == "read_file" or len(lines) < 20:
        start = rng.randrange(max(1, len(lines) - 40))
        end = _excerpt(lines, start, tokens, count)
        body = "\n".join(f"{n + 1:5d}  {lines[n]}" for n in range(start, end))
        args = {"path": path, "start_line": start + 1, "end_line": end}
        return Turn({"name": "read_file", "arguments": args}, body)
    if kind == "search_code":
        words = [w for line in lines for w in line.replace("(", " ").split() if w.isidentifier()]
        pattern = rng.choice([w for w in words if len(w) > 5] or ["def"])
        hits = [f"{p}:{n + 1}: {text.strip()}" for p in repo.files if p.endswith(".py")
                for n, text in enumerate(repo.lines(p)) if pattern in text]  # fmt: skip
        end = _excerpt(hits, 0, tokens, count)
        return Turn({"name": "search_code", "arguments": {"pattern": pattern}},
                    "\n".join(hits[:end]) or "no matches")  # fmt: skip
    if kind == "run_tests":
        tests = [p for p in repo.files if p.startswith("tests/") and p.endswith(".py")]
        target = rng.choice(tests)
        names = [ln.split("(")[0][4:] for ln in repo.lines(target) if ln.startswith("def test_")]
        report = [f"{target}::{n} PASSED" for n in names[:-1]]
        failing = names[-1] if names else "test_it"
        report += [f"{target}::{failing} FAILED", "", "=" * 30 + " FAILURES " + "=" * 30,
                   f"_____ {failing} _____", ""]  # fmt: skip
        start = rng.randrange(max(1, len(lines) - 40))
        end = _excerpt(lines, start, tokens - count("\n".join(report)), count)
        report += [f"{path}:{n + 1}: {lines[n]}" for n in range(start, end)]
        report += ["E       AssertionError", f"1 failed, {len(names) - 1} passed in 3.2s"]
        return Turn({"name": "run_tests", "arguments": {"target": target}}, "\n".join(report))
    folder = path.rsplit("/", 1)[0]
    entries = []
    for p in sorted(f for f in repo.files if f.startswith(folder + "/")):
        first = next((ln.strip('"# ') for ln in repo.lines(p) if ln.strip()), "")
        entries.append(f"{p}  ({len(repo.lines(p))} lines)  {first[:100]}")
    listing = entries[: _excerpt(entries, 0, tokens, count)]
    return Turn({"name": "list_directory", "arguments": {"path": folder}}, "\n".join(listing))


def make_trace(session: int, system: str, repo: Repo, count: Callable[[str], int]) -> Trace:
    rng = random.Random(f"densa-agent-trace/{session}")
    num_turns = rng.randrange(10, 13)  # the 10-20, kept short for a 2-core CPU
    turns = [make_turn(repo, rng, count) for _ in range(num_turns)]
    return Trace(session, system, TASKS[session % len(TASKS)], turns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="whose tokenizer sizes text")
    parser.add_argument("--out", type=Path, default=TRACES_DIR)
    ns = parser.parse_args()
    from densa.model.catalog import resolve_model_arg
    from densa.model.loader import resolve_model_dir
    from densa.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(resolve_model_dir(resolve_model_arg(ns.model)))

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    repo = Repo()
    system = system_prompt(repo, count)
    ns.out.mkdir(parents=True, exist_ok=True)
    for session in range(NUM_SESSIONS):
        trace = make_trace(session, system, repo, count)
        data = {**asdict(trace), "source_commit": SOURCE_COMMIT,
                "result_tokens": [count(t.result) for t in trace.turns]}  # fmt: skip
        (ns.out / f"session_{session:02d}.json").write_text(json.dumps(data, indent=1) + "\n")
        print(f"session {session}: {len(trace.turns)} turns, result tokens "
              f"{data['result_tokens']}")  # fmt: skip


if __name__ == "__main__":
    main()
