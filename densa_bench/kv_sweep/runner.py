"""`densa bench kv-sweep`: BF16 vs FP8 KV cache under one fixed KV memory budget, concurrency 1..64.

The budget holds `budget_requests` whole BF16 requests (prompt + output tokens); FP8 holds ~2x as
many in the same bytes. Each KV dtype gets its own engine (same weights, same budget in bytes) and
the waves run interleaved (bf16 c=1, fp8 c=1, bf16 c=8, ...): a wave submits `c` requests at once
(random prompts, no shared prefix pages, EOS ignored) and ends when all finish. When a format runs
out of pages, requests wait for pages or are preempted and recomputed: that is where capacity
shows up, as in the reference deployment where BF16 ran out of memory at 64 requests.

Beyond the serving numbers, every engine step is timed and classed as a decode-only step or a step
carrying prefill tokens. That split is the profile that explains the shape of the curves on a
machine where prefill is slow: decode tok/s is what a larger decode batch buys, and the prefill
share is the part of a wave that more capacity cannot speed up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from densa.engine.llm_engine import LLMEngine
from densa.engine.metrics import snapshot
from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig
from densa.model.kv_pages import kv_capacity, page_bytes
from densa.model.loader import resolve_model_dir
from densa.sched.output import SchedulerOutput
from densa.setup.args import EngineArgs
from densa.utils.logging import get_logger
from densa.utils.progress import progress
from densa_bench.common.report import BenchReport
from densa_bench.common.stats import interleave
from densa_bench.common.timing import RequestTiming, Wave
from densa_bench.kv_sweep.report import build_report
from densa_bench.kv_sweep.settings import KVSweepSettings
from densa_bench.serving.runner import DensaEngine, ServingSettings, make_prompts, timed_wave

logger = get_logger(__name__)


def kv_budget_bytes(arch: ArchConfig, settings: KVSweepSettings, page_size: int) -> int:
    """`budget_requests` BF16 requests' worth of whole pages, in bytes."""
    pages_per_request = -(-settings.request_len // page_size)
    bf16_request_bytes = pages_per_request * page_bytes(arch, page_size, KVFormat.of("bfloat16"))
    return int(settings.budget_requests * bf16_request_bytes)


# ---- an engine that profiles its steps -------------------------------------------------------
@dataclass
class StepProfile:
    """Per-wave totals over engine steps, split by whether a step carried prefill tokens."""

    decode_steps: int = 0
    decode_s: float = 0.0
    decode_tokens: int = 0  # output tokens sampled in decode-only steps
    prefill_steps: int = 0  # steps with at least one prefill chunk (decodes may ride along)
    prefill_s: float = 0.0
    prefill_tokens: int = 0  # prompt tokens computed, recomputation after preemption included
    peak_running: int = 0  # most requests running at once: how many were admitted concurrently

    def record(self, step: SchedulerOutput, seconds: float, num_running: int) -> None:
        # Decode chunks are the one-token chunks past the prompt; the chunk says only its token
        # count, so one-token prompt chunks (rare: a fully cached prompt) count as decodes here.
        num_decodes = sum(1 for item in step.scheduled if item.num_tokens == 1)
        num_prefill_tokens = sum(item.num_tokens for item in step.scheduled) - num_decodes
        self.peak_running = max(self.peak_running, num_running)
        if num_prefill_tokens:
            self.prefill_steps += 1
            self.prefill_s += seconds
            self.prefill_tokens += num_prefill_tokens
        elif num_decodes:
            self.decode_steps += 1
            self.decode_s += seconds
            self.decode_tokens += num_decodes


class ProfiledEngine(DensaEngine):
    """densa driven wave by wave, timing each runner step (the forward pass and sampling)."""

    def __init__(self, engine: LLMEngine, name: str) -> None:
        super().__init__(engine)
        self.name = name
        self.profile = StepProfile()
        engine.observers.add(lambda r: self.profile.record(r.step, r.seconds, r.num_running))

    def run_wave(self, prompts: list[list[int]], output_len: int) -> list[RequestTiming]:
        self.profile = StepProfile()
        return super().run_wave(prompts, output_len)

    def wave_stats(self) -> dict[str, int]:
        profile = self.profile
        return {
            **super().wave_stats(),
            "peak_running": profile.peak_running,
            "decode_steps": profile.decode_steps,
            "decode_us": round(profile.decode_s * 1e6),
            "decode_tokens": profile.decode_tokens,
            "prefill_steps": profile.prefill_steps,
            "prefill_us": round(profile.prefill_s * 1e6),
            "prefill_tokens": profile.prefill_tokens,
        }


# ---- the run ---------------------------------------------------------------------------------
def load_engines(settings: KVSweepSettings, engine_args: EngineArgs) -> list[ProfiledEngine]:
    """One engine per KV dtype, each with the same KV budget in bytes."""
    arch = ArchConfig.from_dir(resolve_model_dir(engine_args.model or _default_model()))
    budget = kv_budget_bytes(arch, settings, engine_args.page_size)
    engines = []
    for kv_dtype in settings.kv_dtypes:
        args = replace(
            engine_args,
            kv_cache_dtype=kv_dtype,
            kv_cache_memory=f"{budget}B",
            num_kv_pages=None,
            max_model_len=engine_args.max_model_len or settings.request_len,
            enable_prefix_caching=False,  # random prompts share nothing; keep the runs alike
        )
        logger.info("loading densa with --kv-cache-dtype %s, KV budget %d bytes", kv_dtype, budget)
        engines.append(ProfiledEngine(LLMEngine.from_args(args), kv_dtype))
    return engines


def run_kv_sweep(settings: KVSweepSettings, engine_args: EngineArgs) -> BenchReport:
    engines = load_engines(settings, engine_args)
    vocab_size = engines[0].engine.arch.vocab_size
    serving = settings.serving()
    _warm_up(engines, serving, vocab_size)
    schedule = interleave([(c, e) for c in settings.concurrency for e in engines], settings.repeats)
    waves: list[Wave] = []
    with progress(len(schedule), "bench kv-sweep") as bar:
        for repeat_idx, (concurrency, engine) in schedule:
            key = f"c{concurrency}-r{repeat_idx}"  # every KV dtype gets the same prompts
            prompts = make_prompts(serving, vocab_size, concurrency, key)
            waves.append(timed_wave(engine, prompts, serving, repeat_idx))
            bar.update()
            stats = waves[-1].engine_stats
            logger.info(
                "[%d/%d] %s c=%d: %.1f output tok/s, peak running %d, %d preemptions",
                len(waves), len(schedule), engine.name, concurrency, waves[-1].output_tok_s,
                stats["peak_running"], stats["preemptions"],
            )  # fmt: skip
    return build_report(waves, _report_settings(settings, engine_args, engines))


def _warm_up(engines: list[ProfiledEngine], serving: ServingSettings, vocab_size: int) -> None:
    """Compile kernels and touch every KV page once: a full-budget wave of short outputs."""
    for warmup_idx in range(serving.warmup):
        prompts = make_prompts(serving, vocab_size, max(serving.concurrency), f"warmup{warmup_idx}")
        for engine in engines:
            logger.info("warm-up %d/%d: %s", warmup_idx + 1, serving.warmup, engine.name)
            engine.run_wave(prompts, min(serving.output_len, 8))


def _report_settings(
    settings: KVSweepSettings, engine_args: EngineArgs, engines: list[ProfiledEngine]
) -> dict[str, Any]:
    first = engines[0].engine
    arch, page_size = first.arch, first.config.cache.page_size
    budget = kv_budget_bytes(arch, settings, page_size)
    capacity = {}
    for engine in engines:
        cache = engine.engine.config.cache
        row = kv_capacity(arch, budget, page_size, KVFormat.of_cache(cache))
        num_pages = snapshot(engine.engine).num_kv_pages
        capacity[engine.name] = {
            "kv_scales": row.kv_scales or "-",
            "bytes_per_token": row.bytes_per_token,
            "kv_pages": num_pages,
            "resident_tokens": num_pages * page_size,
            "requests_that_fit": row.max_requests(settings.request_len),
        }
    return {
        "benchmark": asdict(settings),
        "model": first.config.model.model,
        "kv_budget_bytes": budget,
        "capacity": capacity,
        "engine": {k: str(v) for k, v in asdict(engine_args).items()},
        "prompts": "random token ids, distinct per request and wave (no shared prefix pages)",
    }


def _default_model() -> str:
    from densa.setup.args import default_model_path

    return default_model_path()
