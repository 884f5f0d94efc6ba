"""`densa bench serving`: throughput and latency at fixed concurrency levels, densa vs transformers.

One wave = `c` requests submitted at once, run until all finish. Each engine is loaded once, warmed
up, then the waves run interleaved (densa c=1, hf c=1, densa c=8, hf c=8, ..., then the next
repetition), so both engines see the same machine state. Both get the same prompts in a wave.

Prompts are random token ids (seeded, different in every wave and request): no two requests share a
prefix page, so densa's prefix cache cannot help, and the text content does not change the work.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from densa.engine.llm_engine import LLMEngine
from densa.engine.metrics import snapshot
from densa.ipc.messages import RequestDelta
from densa.model.loader import resolve_model_dir
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs, default_model_path
from densa.utils.logging import get_logger
from densa.utils.progress import progress
from densa_bench.common.hardware import PeakRSS
from densa_bench.common.report import BenchReport
from densa_bench.common.stats import interleave
from densa_bench.common.timing import RequestTiming, ServingEngine, Wave
from densa_bench.serving.report import build_report
from densa_bench.serving.settings import ServingSettings

logger = get_logger(__name__)

DETERMINISTIC = "densa-deterministic"  # the engine name of densa --deterministic
# Ids below this are special and byte-level tokens in common BPE vocabularies; keep prompts plain.
FIRST_PROMPT_TOKEN_ID = 256


class DensaEngine:
    """densa's in-process LLMEngine as a ServingEngine, driven with `step()`."""

    def __init__(self, engine: LLMEngine, name: str = "densa") -> None:
        self.engine = engine
        self.name = name
        self._stats: dict[str, int] = {}

    def run_wave(self, prompts: list[list[int]], output_len: int) -> list[RequestTiming]:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        preemptions_before = snapshot(self.engine).num_preemptions
        timings: dict[str, RequestTiming] = {}
        for prompt in prompts:
            submit_s = time.perf_counter()
            timings[self.engine.add_request(prompt, params)] = RequestTiming(submit_s)
        min_free_pages = snapshot(self.engine).num_free_kv_pages
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            now = time.perf_counter()
            for out in outputs:
                _absorb(timings[out.request_id], out, now)
            min_free_pages = min(min_free_pages, snapshot(self.engine).num_free_kv_pages)
        stats = snapshot(self.engine)
        self._stats = {
            "kv_pages_total": stats.num_kv_pages,
            "kv_pages_peak_used": stats.num_kv_pages - min_free_pages,
            "preemptions": stats.num_preemptions - preemptions_before,
        }
        return list(timings.values())

    def wave_stats(self) -> dict[str, int]:
        return self._stats


def _absorb(timing: RequestTiming, out: RequestDelta, now: float) -> None:
    if out.error is not None:
        raise RuntimeError(f"densa request {out.request_id} failed: {out.error}")
    timing.token_s.extend([now] * len(out.new_token_ids))
    if out.finished:
        timing.num_cached_tokens = out.num_cached_tokens


# ---- prompts ---------------------------------------------------------------------------------
def make_prompts(
    settings: ServingSettings, vocab_size: int, count: int, wave_key: str
) -> list[list[int]]:
    """`count` random prompts, reproducible from (prompt_seed, wave_key), different for each key."""
    rng = random.Random(f"{settings.prompt_seed}/{wave_key}")  # str seeds hash deterministically
    return [
        [rng.randrange(FIRST_PROMPT_TOKEN_ID, vocab_size) for _ in range(settings.prompt_len)]
        for _ in range(count)
    ]


# ---- the run ---------------------------------------------------------------------------------
def load_engines(settings: ServingSettings, engine_args: EngineArgs) -> list[ServingEngine]:
    """densa (and the HF peer on the same weights), each loaded once for the whole run."""
    logger.info("loading densa engine")
    engines: list[ServingEngine] = [DensaEngine(LLMEngine.from_args(engine_args))]
    if settings.deterministic_pair:
        logger.info("loading densa engine with --deterministic")
        plain = dataclasses.replace(engine_args, deterministic=False)
        engines = [
            DensaEngine(LLMEngine.from_args(plain)),
            DensaEngine(LLMEngine.from_args(dataclasses.replace(plain, deterministic=True)),
                        DETERMINISTIC),
        ]  # fmt: skip
    if settings.include_hf:
        from densa_bench.serving.hf_baseline import (
            HFGenerate,  # transformers loads only when asked for
        )

        model_dir = resolve_model_dir(engine_args.model or default_model_path())
        logger.info("loading transformers model from %s", model_dir)
        engines.append(HFGenerate(model_dir))
    return engines


def run_serving(settings: ServingSettings, engine_args: EngineArgs) -> BenchReport:
    """Load, warm up, run every (concurrency, engine) wave interleaved; return the report."""
    engines = load_engines(settings, engine_args)
    vocab_size = _densa(engines).engine.arch.vocab_size
    warm_up(engines, settings, vocab_size)
    variants = [(c, engine) for c in settings.concurrency for engine in engines]
    schedule = interleave(variants, settings.repeats)
    waves = []
    with progress(len(schedule), "bench serving") as bar:
        for repeat_idx, (concurrency, engine) in schedule:
            label = f"{engine.name} c={concurrency} rep {repeat_idx + 1}"
            bar.set_postfix_str(label)
            # The same key gives both engines the same prompts within a repetition.
            prompts = make_prompts(
                settings, vocab_size, concurrency, f"c{concurrency}-r{repeat_idx}"
            )
            waves.append(timed_wave(engine, prompts, settings, repeat_idx))
            bar.update()
            logger.info(
                "[%d/%d] %s: %.1f output tok/s in %.2f s",
                len(waves),
                len(schedule),
                label,
                waves[-1].output_tok_s,
                waves[-1].wall_s,
            )
    return build_report(waves, _report_settings(settings, engine_args, _densa(engines)))


def warm_up(engines: list[ServingEngine], settings: ServingSettings, vocab_size: int) -> None:
    """First passes, allocator growth and first-touch of KV memory happen here, untimed."""
    concurrency = max(settings.concurrency)
    for warmup_idx in range(settings.warmup):
        prompts = make_prompts(settings, vocab_size, concurrency, f"warmup{warmup_idx}")
        for engine in engines:
            logger.info(
                "warm-up %d/%d: %s c=%d", warmup_idx + 1, settings.warmup, engine.name, concurrency
            )
            engine.run_wave(prompts, settings.output_len)


def timed_wave(
    engine: ServingEngine, prompts: list[list[int]], settings: ServingSettings, repeat_idx: int
) -> Wave:
    """Run one wave and check it: every request must have made exactly output_len tokens."""
    rss = PeakRSS()
    rss.start()
    start_s = time.perf_counter()
    timings = engine.run_wave(prompts, settings.output_len)
    wall_s = time.perf_counter() - start_s
    _check_complete(engine.name, timings, settings.output_len)
    return Wave(
        engine=engine.name,
        concurrency=len(prompts),
        repeat_idx=repeat_idx,
        prompt_len=settings.prompt_len,
        wall_s=wall_s,
        requests=timings,
        peak_rss_bytes=rss.peak_bytes(),
        start_rss_bytes=rss.start_bytes,
        engine_stats=engine.wave_stats(),
    )


def _check_complete(name: str, timings: list[RequestTiming], output_len: int) -> None:
    counts = {t.num_output_tokens for t in timings}
    if counts != {output_len}:
        raise RuntimeError(f"{name} produced {sorted(counts)} tokens per request, not {output_len}")
    cached = sum(t.num_cached_tokens for t in timings)
    if cached:
        logger.warning("%s served %d prompt tokens from its prefix cache", name, cached)


def _densa(engines: list[ServingEngine]) -> DensaEngine:
    engine = engines[0]
    assert isinstance(engine, DensaEngine), "load_engines puts densa first"
    return engine


def _report_settings(
    settings: ServingSettings, engine_args: EngineArgs, densa: DensaEngine
) -> dict[str, Any]:
    model = engine_args.model or default_model_path()
    return {
        **asdict(settings),
        "model": str(Path(model)),
        "densa_engine_args": asdict(engine_args),
        "densa_kv_pages": snapshot(densa.engine).num_kv_pages,
        "densa_page_size": densa.engine.config.cache.page_size,
        "hf_generate": "static batch, fp32, greedy, min_new_tokens = max_new_tokens = output_len",
        "prompts": "random token ids, distinct per request and wave (no shared prefix pages)",
    }
