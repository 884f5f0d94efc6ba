"""`densa bench structured`: what grammar-constrained decoding costs per decode step.

One engine runs waves of `concurrency` chat requests, each constrained by one of the test
schemas (densa_bench/structured/schemas.py), greedy, until every answer is complete. Each engine
step is timed, and the sampler's own clocks say how much of it went to filling the token
bitmasks (llguidance) and applying them to the logits (densa's Numba kernel). Only decode steps
count: steps after every request of the wave has its first token. The goal is mask fill +
apply <= 5% of the decode step at c = 8.

Interleaved with those, the same prompts run unconstrained (EOS ignored, as many tokens as the
constrained answers had) so the step times can also be compared end to end. Grammar compile
times are measured cold (empty cache) and warm (cache hit) for every schema.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams, StructuredOutput
from densa.setup.args import EngineArgs
from densa.utils.logging import get_logger
from densa.utils.progress import progress
from densa_bench.common.report import BenchReport, Table
from densa_bench.common.stats import interleave, median, percentile
from densa_bench.structured.schemas import SCHEMA_CASES
from densa_bench.structured.settings import StructuredSettings

logger = get_logger(__name__)
GOAL_PERCENT = 5.0


@dataclass
class StepSample:
    step_s: float
    fill_s: float
    apply_s: float
    num_masks: int


class Compiler(Protocol):
    """What this benchmark times of the engine's grammar compiler (worker/grammar.py)."""

    def compile_now(self, spec: StructuredOutput) -> Any: ...


def run_structured(settings: StructuredSettings, engine_args: EngineArgs) -> BenchReport:
    engine = LLMEngine.from_args(engine_args)
    grammars = engine.runner.grammars
    assert grammars is not None
    compile_times = _time_compiles(grammars)
    _wave(engine, 2, settings, constrained=True, offset=0)  # warm-up: kernels, allocator
    schedule = interleave(
        [(c, constrained) for c in settings.concurrency for constrained in (True, False)],
        settings.repeats,
    )
    samples: list[dict[str, Any]] = []
    lengths: dict[tuple[int, int], int] = {}
    with progress(len(schedule), "bench structured") as bar:
        for repeat, (concurrency, constrained) in schedule:
            offset = repeat * concurrency  # different schemas each repetition
            tokens = lengths.get((concurrency, repeat), settings.max_tokens)
            steps, num_tokens = _wave(engine, concurrency, settings, constrained, offset, tokens)
            lengths[(concurrency, repeat)] = max(num_tokens // concurrency, 1)
            samples += [
                {
                    "concurrency": concurrency,
                    "constrained": constrained,
                    "repeat": repeat,
                    **asdict(s),
                }
                for s in steps
            ]
            bar.update()
    return _report(settings, engine_args, samples, compile_times)


def _time_compiles(grammars: Compiler) -> list[dict[str, Any]]:
    grammars.compile_now(StructuredOutput("json_object"))  # builds the token trie (~1 s) once
    times = []
    for case in SCHEMA_CASES:
        spec = StructuredOutput("json_schema", json.dumps(case.schema))
        start = time.perf_counter()
        grammars.compile_now(spec)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        grammars.compile_now(spec)
        times.append(
            {
                "schema": case.name,
                "cold_ms": cold * 1e3,
                "warm_ms": (time.perf_counter() - start) * 1e3,
            }
        )
    return times


def _wave(
    engine: LLMEngine,
    concurrency: int,
    settings: StructuredSettings,
    constrained: bool,
    offset: int,
    max_tokens: int | None = None,
) -> tuple[list[StepSample], int]:
    """Run one wave to completion: (decode-step samples, output tokens of the wave)."""
    cases = [SCHEMA_CASES[(offset + i) % len(SCHEMA_CASES)] for i in range(concurrency)]
    for case in cases:
        prompt = engine.tokenizer.encode_chat(
            [{"role": "user", "content": f"{case.prompt} Answer in JSON."}]
        )
        spec = StructuredOutput("json_schema", json.dumps(case.schema)) if constrained else None
        params = SamplingParams(
            temperature=0,
            max_tokens=max_tokens or settings.max_tokens,
            ignore_eos=not constrained,
            structured=spec,
        )
        engine.add_request(prompt, params)
    return _drive(engine, concurrency)


def _drive(engine: LLMEngine, concurrency: int) -> tuple[list[StepSample], int]:
    structured = engine.runner.sampler.structured
    assert structured is not None
    times = structured.times
    started: set[str] = set()
    samples: list[StepSample] = []
    num_tokens = 0
    while engine.has_unfinished_requests():
        before = (times.fill_s, times.apply_s, times.num_masks)
        decoding = len(started) == concurrency  # every request is past its prefill
        start = time.perf_counter()
        outputs = engine.step()
        step_s = time.perf_counter() - start
        for output in outputs:
            started.add(output.request_id)
            num_tokens += len(output.new_token_ids)
        if decoding:
            samples.append(
                StepSample(
                    step_s,
                    times.fill_s - before[0],
                    times.apply_s - before[1],
                    times.num_masks - before[2],
                )
            )
    return samples, num_tokens


def _report(
    settings: StructuredSettings,
    engine_args: EngineArgs,
    samples: list[dict[str, Any]],
    compile_times: list[dict[str, Any]],
) -> BenchReport:
    summary = [
        entry
        for concurrency in settings.concurrency
        if (entry := _summarize_level(samples, concurrency)) is not None
    ]
    return BenchReport(
        name="structured",
        settings={**asdict(settings), "model": engine_args.model or "default"},
        samples=samples + [{"compile": t} for t in compile_times],
        summary=summary,
        tables=[_steps_table(summary), _compile_table(compile_times)],
        notes=NOTES,
    )


def _summarize_level(samples: list[dict[str, Any]], concurrency: int) -> dict[str, Any] | None:
    """Medians of one concurrency's constrained and unconstrained decode steps (None when
    either is missing)."""
    mine = [s for s in samples if s["concurrency"] == concurrency]
    on = [s for s in mine if s["constrained"] and s["num_masks"] > 0]
    off = [s for s in mine if not s["constrained"]]
    if not on or not off:
        return None
    share = sum(s["fill_s"] + s["apply_s"] for s in on) / sum(s["step_s"] for s in on)
    p95_share = percentile([(s["fill_s"] + s["apply_s"]) / s["step_s"] for s in on], 95)
    return {
        "concurrency": concurrency,
        "decode_steps": len(on),
        "step_ms_constrained": median([s["step_s"] for s in on]) * 1e3,
        "step_ms_unconstrained": median([s["step_s"] for s in off]) * 1e3,
        "fill_ms_median": median([s["fill_s"] for s in on]) * 1e3,
        "apply_ms_median": median([s["apply_s"] for s in on]) * 1e3,
        "mask_percent_of_step": share * 100,
        "mask_percent_p95": p95_share * 100,
        "meets_goal": share * 100 <= GOAL_PERCENT,
    }


def _steps_table(summary: list[dict[str, Any]]) -> Table:
    rows = [
        [
            str(e["concurrency"]),
            str(e["decode_steps"]),
            f"{e['step_ms_constrained']:.1f}",
            f"{e['step_ms_unconstrained']:.1f}",
            f"{e['fill_ms_median']:.2f}",
            f"{e['apply_ms_median']:.3f}",
            f"{e['mask_percent_of_step']:.2f}% (p95 {e['mask_percent_p95']:.2f}%)",
            "yes" if e["meets_goal"] else "NO",
        ]
        for e in summary
    ]
    return Table(
        "Decode steps under a JSON-schema constraint (medians)",
        [
            "c",
            "steps",
            "step ms (constrained)",
            "step ms (unconstrained)",
            "mask fill ms",
            "mask apply ms",
            "fill + apply, share of step",
            f"<= {GOAL_PERCENT:g}%",
        ],
        rows,
    )


def _compile_table(compile_times: list[dict[str, Any]]) -> Table:
    cold = [t["cold_ms"] for t in compile_times]
    warm = [t["warm_ms"] for t in compile_times]
    row = [str(len(cold)), f"{median(cold):.2f}", f"{max(cold):.2f}", f"{median(warm) * 1e3:.1f}"]
    return Table(
        "Grammar compile (llguidance, per schema)",
        ["schemas", "cold ms (median)", "cold ms (max)", "cache hit us (median)"],
        [row],
    )


NOTES = [
    "fill = llguidance computing the allowed-token bitmask of every constrained row "
    "(rows filled in parallel by its executor); apply = densa's Numba kernel setting "
    "disallowed logits to -inf. Share = total fill + apply time over total decode-step "
    "time across all timed steps of that concurrency.",
    "Unconstrained waves decode the same prompts for the same number of tokens with EOS "
    "ignored; their step time is the comparison end to end (noisier than the share).",
]
