"""`densa bench prefix`: what the prefix cache buys in time to first token (TTFT).

Two experiments on one in-process engine, one request at a time, variants interleaved:

1. Shared prefix. A prefix of P tokens is cached once; then, alternately, a request of that prefix
   plus a new suffix ("cached") and a request of a never-seen prefix plus a suffix of the same
   length ("cold"). Repeated for each P; the ratio cold / cached is taken per repetition.
2. Multi-turn chat. A conversation of T turns (each turn: the whole history + a new user message,
   then the answer joins the history), once with every turn in one cache scope and session
   ("cached") and once with each turn in a fresh cache scope ("uncached": no lookup can hit, the
   work of --no-enable-prefix-caching), alternating conversations. TTFT per turn.

Prompts are random token ids (fresh for every request and conversation, so only the intended
prefix can hit). TTFT = add_request -> the step output that carries the first token.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from densa.engine.llm_engine import LLMEngine
from densa.engine.metrics import snapshot
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from densa.utils.logging import get_logger
from densa.utils.progress import progress
from densa_bench.common.report import BenchReport, LinePlot, Series, Table
from densa_bench.common.stats import format_spread, interleave, spread
from densa_bench.prefix.settings import PrefixSettings

logger = get_logger(__name__)

FIRST_PROMPT_TOKEN_ID = 256  # below: special and byte tokens in common BPE vocabularies
GOAL_SPEEDUP = 5.0  # the goal: >= 5x lower TTFT with a cached 1024-token prefix


@dataclass(frozen=True)
class Timed:
    ttft_s: float
    num_prompt_tokens: int
    num_cached_tokens: int
    output_ids: list[int]


class PrefixBench:
    """One engine, driven a request at a time with `step()`."""

    def __init__(self, engine: LLMEngine, settings: PrefixSettings) -> None:
        self.engine = engine
        self.settings = settings
        self._rng = random.Random(settings.seed)

    def fresh_ids(self, count: int) -> list[int]:
        vocab = self.engine.arch.vocab_size
        return [self._rng.randrange(FIRST_PROMPT_TOKEN_ID, vocab) for _ in range(count)]

    def timed(
        self, prompt: list[int], max_tokens: int, scope: str, session: str | None = None
    ) -> Timed:
        """Run one request alone to completion; its TTFT and what it generated."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        submit_s = time.perf_counter()
        request_id = self.engine.add_request(prompt, params, cache_scope=scope, session_id=session)
        first_s, final, tokens = None, None, []
        while final is None:
            for out in self.engine.step():
                if out.request_id != request_id:
                    continue
                if out.error is not None:
                    raise RuntimeError(f"request {request_id} failed: {out.error}")
                first_s = first_s or (time.perf_counter() if out.new_token_ids else None)
                tokens += out.new_token_ids
                final = out if out.finished else None
        assert first_s is not None
        return Timed(first_s - submit_s, len(prompt), final.num_cached_tokens, tokens)

    # ---- experiment 1 --------------------------------------------------------------------------
    def shared_prefix(self, prefix: list[int], variant: str) -> Timed:
        """`cached`: the cached prefix + a new suffix; `cold`: a new prefix of the same length."""
        head = prefix if variant == "cached" else self.fresh_ids(len(prefix))
        return self.timed(head + self.fresh_ids(self.settings.suffix_len), 1, scope="shared")

    # ---- experiment 2 --------------------------------------------------------------------------
    def conversation(self, variant: str) -> list[Timed]:
        """Every turn of one new conversation; `uncached` puts each turn in its own scope."""
        s = self.settings
        scope = f"chat-{uuid.uuid4().hex}"
        session: str | None = f"session-{uuid.uuid4().hex}"
        history = self.fresh_ids(s.system_len)
        turns = []
        for _ in range(s.turns):
            if variant == "uncached":
                scope, session = f"chat-{uuid.uuid4().hex}", None
            turn = self.timed(history, s.answer_len, scope, session)
            turns.append(turn)
            history = history + turn.output_ids + self.fresh_ids(s.user_len)
        return turns


def run_prefix(settings: PrefixSettings, engine_args: EngineArgs) -> BenchReport:
    if not engine_args.enable_prefix_caching:
        raise ValueError("the prefix benchmark needs prefix caching on")
    bench = PrefixBench(LLMEngine.from_args(engine_args), settings)
    prefixes = {n: bench.fresh_ids(n) for n in settings.prefix_lens}
    _warm_up(bench, prefixes)
    shared = [(n, variant) for n in settings.prefix_lens for variant in ("cached", "cold")]
    chats = interleave(["cached", "uncached"], settings.repeats)
    samples: list[dict[str, Any]] = []
    with progress(settings.repeats * len(shared) + len(chats), "bench prefix") as bar:
        for repeat_idx in range(settings.repeats):
            for prefix_len, variant in shared:
                timed = bench.shared_prefix(prefixes[prefix_len], variant)
                samples.append(_sample("shared_prefix", variant, repeat_idx, timed, prefix_len))
                bar.update()
        for repeat_idx, variant in chats:
            for turn_idx, timed in enumerate(bench.conversation(variant)):
                samples.append(_sample("multi_turn", variant, repeat_idx, timed, turn=turn_idx))
            bar.update()
            logger.info("conversation %s rep %d done", variant, repeat_idx + 1)
    return build_report(samples, settings, engine_args, bench.engine)


def _warm_up(bench: PrefixBench, prefixes: dict[int, list[int]]) -> None:
    """First prefill and decode passes (and JIT compilation) untimed; then every shared prefix
    goes into the cache, which is what the cached variant relies on."""
    s = bench.settings
    for _ in range(s.warmup):
        for prefix in prefixes.values():
            bench.shared_prefix(prefix, "cold")
        bench.timed(bench.fresh_ids(s.system_len), s.answer_len, scope="warm-up")
    for prefix in prefixes.values():
        bench.timed(prefix + bench.fresh_ids(s.suffix_len), 1, scope="shared")


def _sample(
    experiment: str,
    variant: str,
    repeat_idx: int,
    timed: Timed,
    prefix_len: int | None = None,
    turn: int | None = None,
) -> dict[str, Any]:
    return {
        "experiment": experiment,
        "variant": variant,
        "repeat_idx": repeat_idx,
        "prefix_len": prefix_len,
        "turn": turn,
        "ttft_s": timed.ttft_s,
        "prompt_tokens": timed.num_prompt_tokens,
        "cached_tokens": timed.num_cached_tokens,
    }


# ---- the report ---------------------------------------------------------------------------------
NOTES = [
    "TTFT = add_request -> the engine step that returns the first token, one request at a time "
    "(no batching effects); medians with the min..max spread over repetitions.",
    "The ratio is uncached / cached TTFT, taken per repetition (adjacent, interleaved runs).",
    "Multi-turn 'uncached' runs each turn in a fresh cache scope, so nothing can hit: the same "
    "work as --no-enable-prefix-caching (plus block hashing, microseconds).",
    "The cached request still computes its suffix (and, in chat, the newest turn) and the first "
    "token: the speed-up grows with the share of the prompt that is cached.",
]


def build_report(
    samples: list[dict[str, Any]],
    settings: PrefixSettings,
    engine_args: EngineArgs,
    engine: LLMEngine,
) -> BenchReport:
    shared = _by_key(samples, "shared_prefix", "prefix_len", "cold", "cached")
    chat = _by_key(samples, "multi_turn", "turn", "uncached", "cached")
    summary = [{"experiment": "shared_prefix", **row} for row in shared]
    summary += [{"experiment": "multi_turn", **row} for row in chat]
    headline = next((r for r in shared if r["key"] == 1024), shared[-1])
    report = BenchReport(
        name="prefix",
        settings={
            **asdict(settings),
            "engine_args": asdict(engine_args),
            "kv_pages": snapshot(engine).num_kv_pages,
            "page_size": engine.config.cache.page_size,
            "goal": f">= {GOAL_SPEEDUP:g}x lower TTFT with a cached 1024-token prefix",
        },
        samples=samples,
        summary=summary,
        notes=[
            f"Headline: a {headline['key']}-token cached prefix cuts TTFT "
            f"{headline['ratio']['median']:.1f}x (goal >= {GOAL_SPEEDUP:g}x: "
            f"{'met' if headline['ratio']['median'] >= GOAL_SPEEDUP else 'NOT met'}).",
            *NOTES,
        ],
    )
    report.tables = [
        _table("Shared prefix: TTFT (ms)", "prefix tokens", "cold", shared),
        _table("Multi-turn chat: TTFT per turn (ms)", "turn", "uncached", chat),
    ]
    report.plots = [
        _plot("shared_prefix_ttft", "TTFT, shared prefix vs cold", "prefix tokens", shared),
        _plot("multi_turn_ttft", "TTFT per chat turn", "turn", chat),
    ]
    return report


def _by_key(
    samples: list[dict[str, Any]], experiment: str, key: str, base: str, cached: str
) -> list[dict[str, Any]]:
    """Per key value: TTFT spread of each variant, cached tokens, and the per-repetition ratio."""
    ttft: dict[tuple[Any, str], dict[int, float]] = defaultdict(dict)
    cached_tokens: dict[Any, list[int]] = defaultdict(list)
    for s in samples:
        if s["experiment"] == experiment:
            ttft[(s[key], s["variant"])][s["repeat_idx"]] = s["ttft_s"]
            if s["variant"] == cached:
                cached_tokens[s[key]].append(s["cached_tokens"])
    rows = []
    for value in sorted({k for k, _ in ttft}):
        base_t, cached_t = ttft[(value, base)], ttft[(value, cached)]
        ratios = [base_t[r] / cached_t[r] for r in base_t if r in cached_t]
        rows.append(
            {
                "key": value,
                base: spread(list(base_t.values())),
                "cached": spread(list(cached_t.values())),
                "ratio": spread(ratios),
                "cached_tokens": max(cached_tokens[value], default=0),
            }
        )
    return rows


def _table(title: str, key_name: str, base: str, rows: list[dict[str, Any]]) -> Table:
    def ms(stats: dict[str, float]) -> str:
        return format_spread({k: v * 1000 for k, v in stats.items()}, digits=0)

    body = [
        [
            str(r["key"] + 1 if key_name == "turn" else r["key"]),
            ms(r[base]),
            ms(r["cached"]),
            str(r["cached_tokens"]),
            format_spread(r["ratio"]),
        ]
        for r in rows
    ]
    columns = [key_name, base, "cached", "cached tokens", f"{base} / cached"]
    return Table(title, columns, body)


def _plot(name: str, title: str, x_label: str, rows: list[dict[str, Any]]) -> LinePlot:
    xs = [float(r["key"] + 1 if x_label == "turn" else r["key"]) for r in rows]
    base = "uncached" if x_label == "turn" else "cold"
    series = [
        Series(
            label,
            xs,
            [r[v]["median"] * 1000 for r in rows],
            [r[v]["min"] * 1000 for r in rows],
            [r[v]["max"] * 1000 for r in rows],
        )
        for label, v in ((base, base), ("prefix cache hit", "cached"))
    ]
    return LinePlot(name, title, x_label, "TTFT (ms)", series)
