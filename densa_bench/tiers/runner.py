"""`densa bench tiers`: agent-like sessions whose history the device pool cannot all keep, with
the KV tiers off, on a local disk, and in a shared Redis store; one worker and two.

The workload: S sessions (agents), each with its own system prompt of tool schemas (JSON, ~2-4k
tokens on the real model; each session is its own tenant, so nothing is shared across them), then
T turns: the whole history + a new user message, the answer (greedy) joining the history. Turns
are interleaved round-robin over the sessions, so between two turns of one session every other
session runs one (that is its think-time); the device pool is sized to hold about
`pool_share` of the live sessions' contexts, so most returning turns find their history evicted.

Workers are in-process engines run one request at a time (no contention between them: the
figures are per-request costs). With two workers, turn t of session s goes to worker (s + t) % 2:
round-robin placement, every turn on the other worker. Tiers: `disk` gives each worker its own
directory (a local disk), `shared` one redis-server both reach.

Per configuration: the hit rate (cached prompt tokens / prompt tokens of returning turns), the
workload's ceiling (what a cache that never forgets would hit: every full block computed before
in the session), TTFT of returning turns (p50 / p95), and throughput (prompt + output tokens per
second of wall time).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from densa.auth.secret import ClusterSecret
from densa.cache.prefix_index import hash_block
from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from densa.utils.logging import get_logger
from densa_bench.common.report import BenchReport, LinePlot, Series, Table
from densa_bench.common.stats import percentile
from densa_bench.tiers.settings import TiersSettings

logger = get_logger(__name__)


@dataclass
class Turn:
    session: int
    turn: int
    worker: int
    prompt_tokens: int
    cached_tokens: int
    ceiling_tokens: int
    ttft_s: float
    seconds: float
    output_tokens: int
    output: list[int]


def system_prompt(tokenizer: Any, session: int, num_tokens: int) -> list[int]:
    """Tool schemas of one agent (its own names), as JSON text, cut to `num_tokens`."""
    tools = []
    idx = 0
    while True:
        tools.append({"type": "function", "function": {
            "name": f"agent{session}_tool{idx}",
            "description": f"Tool {idx} of agent {session}: reads, searches or edits files in the "
            "workspace, runs commands and reports what happened, as JSON.",
            "parameters": {"type": "object", "properties": {
                "path": {"type": "string", "description": "a path inside the workspace"},
                "query": {"type": "string", "description": f"what to look for ({idx})"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 100 + idx},
            }, "required": ["path"]},
        }})  # fmt: skip
        text = f"You are agent {session}. Tools:\n" + json.dumps(tools, indent=1)
        tokens = tokenizer.encode(text)
        if len(tokens) >= num_tokens:
            return tokens[:num_tokens]
        idx += 1


def user_message(tokenizer: Any, session: int, turn: int, num_tokens: int) -> list[int]:
    text = (
        f"Turn {turn} for agent {session}: the test run printed a failure in module "
        f"m{turn}_{session}; look at it, call the tools you need, and say what to change. "
    )
    tokens = tokenizer.encode(text * (1 + num_tokens // 8), add_special_tokens=False)
    return tokens[:num_tokens]


def ceiling_tokens(history: list[int], computed: list[int], page_size: int, scope: str) -> int:
    """Tokens a cache that never forgets would serve: full blocks of `computed` (the session's
    tokens whose K/V was written before) that `history` starts with."""
    cap = (len(history) - 1) // page_size
    num = 0
    parent = None
    for block in range(min(cap, len(computed) // page_size)):
        start = block * page_size
        if history[start : start + page_size] != computed[start : start + page_size]:
            break
        parent = hash_block(parent, history[start : start + page_size], scope)
        num += 1
    return num * page_size


class Workload:
    def __init__(self, settings: TiersSettings, tokenizer: Any, page_size: int) -> None:
        self.settings = settings
        self.page_size = page_size
        self.systems = [system_prompt(tokenizer, s, settings.system_tokens)
                        for s in range(settings.num_sessions)]  # fmt: skip
        self.users = [[user_message(tokenizer, s, t, settings.user_tokens)
                       for t in range(settings.num_turns)]
                      for s in range(settings.num_sessions)]  # fmt: skip


def run_config(engines: list[LLMEngine], workload: Workload, variant: str) -> list[Turn]:
    s = workload.settings
    histories = [list(system) for system in workload.systems]
    computed: list[list[int]] = [[] for _ in histories]
    turns = []
    for turn in range(s.num_turns):
        for session in range(s.num_sessions):
            history = histories[session] + workload.users[session][turn]
            worker = (session + turn) % len(engines)
            scope = f"agent-{session}"
            ceiling = ceiling_tokens(history, computed[session], workload.page_size, scope)
            result = _run_one(engines[worker], history, scope, s.max_tokens)
            turns.append(Turn(session, turn, worker, len(history), result[0], ceiling, result[1],
                              result[2], len(result[3]), result[3]))  # fmt: skip
            histories[session] = history + result[3]
            computed[session] = history + result[3][:-1]
    return turns


def _run_one(
    engine: LLMEngine, prompt: list[int], scope: str, max_tokens: int
) -> tuple[int, float, float, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    request_id = engine.add_request(prompt, params, cache_scope=scope)
    first = None
    tokens: list[int] = []
    cached = 0
    while True:
        for delta in engine.step():
            if delta.request_id != request_id:
                continue
            tokens += delta.new_token_ids
            if first is None and tokens:
                first = time.perf_counter() - started
            if delta.finished:
                cached = delta.num_cached_tokens
                # The session's think-time: its pages go down now, not during the next
                # request's prefill (on a 2-core machine a store process competes with the
                # engine's threads for the CPU; measured without this, the shared tier's
                # writes of one turn slowed the next turn's TTFT ~10x).
                engine.flush_tiers()
                return cached, first or 0.0, time.perf_counter() - started, tokens


def summarize(turns: list[Turn]) -> dict[str, Any]:
    returning = [t for t in turns if t.turn > 0]
    prompt = sum(t.prompt_tokens for t in returning)
    cached = sum(t.cached_tokens for t in returning)
    ceiling = sum(t.ceiling_tokens for t in returning)
    ttfts = [t.ttft_s for t in returning]
    seconds = sum(t.seconds for t in turns)
    return {
        "hit_rate": cached / prompt,
        "ceiling_hit_rate": ceiling / prompt,
        "share_of_ceiling": cached / ceiling if ceiling else 0.0,
        "returning_ttft_p50_s": percentile(ttfts, 50),
        "returning_ttft_p95_s": percentile(ttfts, 95),
        "tokens_per_s": sum(t.prompt_tokens + t.output_tokens for t in turns) / seconds,
        "seconds": seconds,
    }


def run_tiers(
    settings: TiersSettings,
    engine_args: EngineArgs,
    on_config: Callable[[BenchReport], None] = lambda report: None,
) -> BenchReport:
    """Run every configuration; `on_config` gets the report so far after each one (a long run
    cut short still leaves its finished configurations on disk)."""
    from densa_bench.common.redis_server import RedisServer

    page_size = engine_args.page_size
    pages_per_session = -(-(settings.final_context + page_size) // page_size)
    num_pages = max(pages_per_session, round(settings.pool_share * settings.num_sessions
                                             * pages_per_session))  # fmt: skip
    args = EngineArgs(**{**asdict(engine_args), "num_kv_pages": num_pages,
                         "max_model_len": pages_per_session * page_size,
                         "max_num_batched_tokens": max(engine_args.max_num_batched_tokens, 512),
                         "kv_tiers": ()})  # fmt: skip
    engines = [LLMEngine.from_args(args) for _ in range(max(settings.workers))]
    for engine in engines:
        engine.warm_up()
        _warm_long_prefill(engine, settings.system_tokens)
    workload = Workload(settings, engines[0].tokenizer, page_size)
    scratch = Path(tempfile.mkdtemp(prefix="densa-bench-tiers-"))
    samples, summary = [], []
    reference_outputs: dict[tuple[int, int], list[int]] = {}
    # The shared tier seals its values with the cluster secret: a file of this run's own (never
    # the process environment, which the caller and every process it starts would inherit).
    secret_file = scratch / "cluster-secret"
    ClusterSecret.generate().write(secret_file)
    try:
        with RedisServer(maxmemory="4gb") as store:
            for num_workers in settings.workers:
                for variant in settings.variants:
                    store.restart()  # an empty store per configuration
                    used = engines[:num_workers]
                    for idx, engine in enumerate(used):
                        engine.detach_tiers()
                        engine.kv_manager.reset_prefix_cache()
                        specs = _tier_specs(variant, scratch / f"{num_workers}-{idx}", store.url)
                        if specs:
                            engine.attach_tiers(specs, str(secret_file))
                    logger.info("tiers bench: %s, %d worker(s)", variant, num_workers)
                    turns = run_config(used, workload, variant)
                    identical = _check_outputs(turns, reference_outputs)
                    tiers = used[0].kv_tiers
                    row = {"variant": variant, "workers": num_workers, **summarize(turns),
                           "outputs_identical": identical,
                           "tier_stats": tiers.stats() if tiers else {}}  # fmt: skip
                    summary.append(row)
                    samples += [{"variant": variant, "workers": num_workers,
                                 **{k: v for k, v in asdict(t).items() if k != "output"}}
                                for t in turns]  # fmt: skip
                    on_config(_report(settings, args, num_pages, summary, samples))
    finally:
        for engine in engines:
            engine.detach_tiers()
        shutil.rmtree(scratch, ignore_errors=True)
    return _report(settings, args, num_pages, summary, samples)


def _warm_long_prefill(engine: LLMEngine, num_tokens: int) -> None:
    """One prompt as long as a system prompt, so no measured turn pays for first-time work
    (kernel compilation for long chunks, allocator growth); then the cache is emptied."""
    prompt = [1000 + i % 20000 for i in range(num_tokens)]
    _run_one(engine, prompt, "warm-up", 2)
    engine.kv_manager.reset_prefix_cache()


def _tier_specs(variant: str, directory: Path, url: str) -> tuple[str, ...]:
    if variant == "disk":
        return (f"disk:{directory}:8GiB",)
    if variant == "shared":
        return (f"shared:{url}",)
    return ()


def _check_outputs(turns: list[Turn], reference: dict[tuple[int, int], list[int]]) -> bool:
    """Greedy answers must not depend on where the K/V came from."""
    same = True
    for t in turns:
        key = (t.session, t.turn)
        same &= reference.setdefault(key, t.output) == t.output
    return same


def _report(
    settings: TiersSettings, args: EngineArgs, num_pages: int, summary: list[dict[str, Any]],
    samples: list[dict[str, Any]],
) -> BenchReport:  # fmt: skip
    off = {row["workers"]: row for row in summary if row["variant"] == "off"}
    disk = {row["workers"]: row for row in summary if row["variant"] == "disk"}
    rows = []
    for row in summary:
        base = off.get(row["workers"])
        speedup = base["returning_ttft_p50_s"] / row["returning_ttft_p50_s"] if base else 0.0
        local = disk.get(row["workers"])
        lift = row["hit_rate"] / local["hit_rate"] if local and local["hit_rate"] else float("inf")
        rows.append([
            row["variant"], str(row["workers"]), f"{row['hit_rate']:.1%}",
            f"{row['ceiling_hit_rate']:.1%}", f"{row['share_of_ceiling']:.1%}",
            f"{row['returning_ttft_p50_s']:.3f}", f"{row['returning_ttft_p95_s']:.3f}",
            f"{speedup:.1f}x",
            f"{lift:.2f}x" if row["variant"] == "shared" and lift != float("inf") else "-",
            f"{row['tokens_per_s']:.0f}", "yes" if row["outputs_identical"] else "NO",
        ])  # fmt: skip
    table = Table(
        "Returning turns (turn >= 2 of each session)",
        ["tiers", "workers", "hit rate", "ceiling", "of ceiling", "TTFT p50 s", "TTFT p95 s",
         "TTFT p50 vs off", "hit rate vs disk", "tokens/s", "same tokens"],
        rows,
    )  # fmt: skip
    series = []
    for row in summary:
        config = (row["variant"], row["workers"])
        per_turn = [s for s in samples if (s["variant"], s["workers"]) == config]
        xs = sorted({s["turn"] + 1 for s in per_turn})
        ys = [percentile([s["ttft_s"] for s in per_turn if s["turn"] + 1 == x], 50) for x in xs]
        series.append(Series(f"{row['variant']}, {row['workers']} worker(s)", xs, ys))
    plot = LinePlot("ttft_per_turn", "TTFT per turn (median over sessions)", "turn",
                    "TTFT, s", series)  # fmt: skip
    settings_dict = {**asdict(settings), "model": args.model or "SmolLM2-135M (bundled)",
                     "kv_cache_dtype": args.kv_cache_dtype, "page_size": args.page_size,
                     "num_kv_pages": num_pages}  # fmt: skip
    notes = [
        "Each worker is an in-process engine serving one request at a time; the turns of all "
        "sessions run round-robin, so a session's think-time is the other sessions' turns.",
        "Ceiling: what a cache that never forgets would hit (every full block the session "
        "computed before); the hit rate counts cached prompt tokens of returning turns.",
        "`same tokens`: every greedy answer equals the first configuration's, token for token.",
    ]
    return BenchReport("tiers", settings_dict, samples=samples, summary=summary,
                       tables=[table], plots=[plot], notes=notes)  # fmt: skip
