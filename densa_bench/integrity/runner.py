"""`densa bench integrity`: what KV integrity checks cost, on vs off, interleaved in one run.

Two engines with identical settings except `--kv-integrity` run the same long-prompt, long-output
waves at each concurrency, alternating (on, off, on, off, ...). Reported per concurrency: output
tokens/s and p95 latencies of each, and the per-repetition ratios. Because end-to-end differences of
well under 1% sit below this machine's run-to-run noise, the check itself is also timed, in the
benchmark's own decode steps (the engine reports it with every step), and expressed as a
fraction of the measured step time.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Any

from densa.engine.hooks import StepRecord
from densa.engine.llm_engine import LLMEngine
from densa.setup.args import EngineArgs
from densa.utils.logging import get_logger
from densa.utils.progress import progress
from densa_bench.common.report import BenchReport, LinePlot, Series, Table
from densa_bench.common.stats import format_spread, interleave, latency_stats, median, spread
from densa_bench.common.timing import Wave
from densa_bench.integrity.settings import IntegritySettings
from densa_bench.serving.runner import DensaEngine, ServingSettings, make_prompts, timed_wave

logger = get_logger(__name__)

NOTES = [
    "on = page generation tags checked before every step (and every copy); off = a no-op checker.",
    "Each ratio is taken between adjacent interleaved runs of the same repetition; a throughput "
    "ratio below 1 or a latency ratio above 1 is overhead. Cells: median (min..max).",
    "check µs / step: the median time of the 'on' engine's batched check in its all-decode steps "
    "of that many requests (RunnerOutput.integrity_check_s, read through LLMEngine.observers), "
    "divided by the measured median inter-token latency of the 'off' runs at that concurrency.",
]


class CheckClock:
    """A step observer (LLMEngine.observers) on the 'on' engine: the integrity check's time in
    each all-decode step, by the number of requests it checked."""

    def __init__(self) -> None:
        self.seconds: dict[int, list[float]] = defaultdict(list)

    def __call__(self, record: StepRecord) -> None:
        scheduled = record.step.scheduled
        if scheduled and all(chunk.num_tokens == 1 for chunk in scheduled):
            self.seconds[len(scheduled)].append(record.output.integrity_check_s)

    def median_us(self, concurrency: int) -> float:
        return median(self.seconds[concurrency]) * 1e6 if self.seconds[concurrency] else 0.0


def run_integrity(settings: IntegritySettings, engine_args: EngineArgs) -> BenchReport:
    engines = _load(engine_args)
    vocab_size = engines[0].engine.arch.vocab_size
    serving = settings.serving()
    _warm_up(engines, serving, vocab_size)
    clock = CheckClock()  # after the warm-up: its steps are not timed
    engines[0].engine.observers.add(clock)
    schedule = interleave([(c, e) for c in settings.concurrency for e in engines], settings.repeats)
    waves: list[Wave] = []
    with progress(len(schedule), "bench integrity") as bar:
        for repeat_idx, (concurrency, engine) in schedule:
            key = f"c{concurrency}-r{repeat_idx}"  # both variants get the same prompts
            prompts = make_prompts(serving, vocab_size, concurrency, key)
            waves.append(timed_wave(engine, prompts, serving, repeat_idx))
            bar.update()
            logger.info(
                "[%d/%d] integrity %s c=%d: %.1f output tok/s",
                len(waves), len(schedule), engine.name, concurrency, waves[-1].output_tok_s,
            )  # fmt: skip
    check_us = {c: clock.median_us(c) for c in settings.concurrency}
    return _report(waves, check_us, settings, engine_args)


def _load(engine_args: EngineArgs) -> list[DensaEngine]:
    engines = []
    for label, enabled in (("on", True), ("off", False)):
        logger.info("loading densa engine with --kv-integrity %s", label)
        engine = DensaEngine(LLMEngine.from_args(replace(engine_args, kv_integrity=enabled)))
        engine.name = label
        engines.append(engine)
    return engines


def _warm_up(engines: list[DensaEngine], serving: ServingSettings, vocab_size: int) -> None:
    prompts = make_prompts(serving, vocab_size, max(serving.concurrency), "warmup")
    for _ in range(serving.warmup):
        for engine in engines:
            logger.info("warm-up: integrity %s", engine.name)
            engine.run_wave(prompts, min(serving.output_len, 16))


# ---- report ----------------------------------------------------------------------------------
def _report(
    waves: list[Wave], check_us: dict[int, float], settings: IntegritySettings, args: EngineArgs
) -> BenchReport:
    groups: dict[tuple[str, int], list[Wave]] = defaultdict(list)
    for wave in waves:
        groups[(wave.engine, wave.concurrency)].append(wave)
    rows = [
        _ratio_row(c, groups[("on", c)], groups[("off", c)], check_us[c])
        for c in settings.concurrency
    ]
    report = BenchReport(
        name="integrity",
        settings={
            "benchmark": settings.__dict__,
            "engine": {k: str(v) for k, v in args.__dict__.items()},
        },
        samples=[_sample(w) for w in waves],
        summary=rows,
        notes=list(NOTES),
    )
    report.tables = [_table(rows)]
    report.plots = [_plot(rows)]
    return report


def _ratio_row(
    concurrency: int, on: list[Wave], off: list[Wave], check_us: float
) -> dict[str, Any]:
    pairs = list(zip(on, off, strict=True))
    off_itl = [gap for w in off for r in w.requests for gap in r.itl_s]
    step_us = median(off_itl) * 1e6
    return {
        "concurrency": concurrency,
        "on_output_tok_s": spread([w.output_tok_s for w in on]),
        "off_output_tok_s": spread([w.output_tok_s for w in off]),
        "throughput_ratio": spread([a.output_tok_s / b.output_tok_s for a, b in pairs]),
        "p95_itl_ratio": spread([_p95(a, "itl") / _p95(b, "itl") for a, b in pairs]),
        "p95_e2e_ratio": spread([_p95(a, "e2e") / _p95(b, "e2e") for a, b in pairs]),
        "check_us": check_us,
        "median_step_us": step_us,
        "check_fraction_of_step": check_us / step_us,
    }


def _p95(wave: Wave, metric: str) -> float:
    if metric == "itl":
        values = [gap for r in wave.requests for gap in r.itl_s]
    else:
        values = [r.e2e_s for r in wave.requests]
    return latency_stats(values)["p95"]


def _sample(wave: Wave) -> dict[str, Any]:
    return {
        "integrity": wave.engine,
        "concurrency": wave.concurrency,
        "repeat_idx": wave.repeat_idx,
        "wall_s": wave.wall_s,
        "output_tok_s": wave.output_tok_s,
        "p95_itl_s": _p95(wave, "itl"),
        "p95_e2e_s": _p95(wave, "e2e"),
    }


def _table(rows: list[dict[str, Any]]) -> Table:
    columns = [
        "c",
        "on tok/s",
        "off tok/s",
        "on/off throughput",
        "on/off p95 ITL",
        "on/off p95 e2e",
        "check µs / step",
        "check / step time",
    ]
    cells = [
        [
            str(r["concurrency"]),
            format_spread(r["on_output_tok_s"]),
            format_spread(r["off_output_tok_s"]),
            format_spread(r["throughput_ratio"], digits=4),
            format_spread(r["p95_itl_ratio"], digits=4),
            format_spread(r["p95_e2e_ratio"], digits=4),
            f"{r['check_us']:.0f}",
            f"{100 * r['check_fraction_of_step']:.3f}%",
        ]
        for r in rows
    ]
    return Table("Integrity checks on vs off (median (min..max) over repetitions)", columns, cells)


def _plot(rows: list[dict[str, Any]]) -> LinePlot:
    x = [r["concurrency"] for r in rows]
    series = [
        Series(
            label,
            x,
            [r[key]["median"] for r in rows],
            [r[key]["min"] for r in rows],
            [r[key]["max"] for r in rows],
        )
        for label, key in (
            ("integrity on", "on_output_tok_s"),
            ("integrity off", "off_output_tok_s"),
        )
    ]
    return LinePlot(
        "output_tok_s",
        "Output tokens/s, integrity on vs off",
        "concurrency",
        "output tokens/s",
        series,
        log_x=True,
    )
