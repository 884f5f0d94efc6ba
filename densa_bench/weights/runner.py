"""`densa bench weights`: BF16 vs FP8 vs INT4 weights (and phase-aware BF16 prefill + INT4
decode) -- checkpoint size, resident weight bytes, prefill tok/s and decode tok/s by concurrency.

Every format's checkpoint is made once from the source with `densa quantize` (cached in
--work-dir) and every engine is loaded once; then the measurements run interleaved: for each
repetition, for each point (prefill, decode c=1, c=8, ...), every format in turn.

- prefill tok/s: one request of --prefill-len random tokens, one output token; prompt tokens
  divided by the time to that token (no prefix cache hits: prompts are distinct).
- decode tok/s at concurrency c: c requests (short prompts) run until each has its first token,
  then the decode steps that produce the remaining --output-len - 1 tokens each are timed.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from densa.engine.llm_engine import LLMEngine
from densa.model.linear import resident_weight_bytes
from densa.model.quantize import QuantizeSettings, quantize_checkpoint
from densa.quant.weight_format import WeightFormat
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs, default_model_path
from densa.utils.logging import get_logger
from densa.utils.progress import progress
from densa.utils.sizes import format_bytes
from densa_bench.common.report import BenchReport, LinePlot, Series, Table
from densa_bench.common.stats import format_spread, interleave, spread
from densa_bench.serving.runner import ServingSettings, make_prompts
from densa_bench.weights.settings import WeightsSettings

logger = get_logger(__name__)

# How each format computes on CPU (fp32 is densa's CPU default: bf16 compute degrades this model).
COMPUTE = {
    "bf16": "weights widened to the compute dtype at load; {dtype} matmuls",
    "fp8": "fp8 weights; decode: fused fp8->fp32 streaming kernel, prefill: dequantize + {dtype}",
    "int4": "int4 weights; torch's packed int4 matmul with bf16 activations, {dtype} elsewhere",
    "bf16+int4": "prefill as bf16, decode as int4 (two weight sets, one KV cache)",
}


@dataclass
class Variant:
    label: str
    engine: LLMEngine
    checkpoint_bytes: int
    resident_bytes: int


# ---- checkpoints and engines -------------------------------------------------------------------
def checkpoint_for(kind: str, source: str, settings: WeightsSettings) -> Path:
    """The source converted to `kind` ("bf16", "fp8", "int4"), made once and cached."""
    fmt = None
    if kind == "fp8":
        fmt = WeightFormat("fp8")
    elif kind == "int4":
        fmt = WeightFormat(
            "int4", group_size=settings.int4_group_size, symmetric=settings.int4_symmetric
        )
    name = kind if fmt is None else re.sub(r"[^a-z0-9]+", "-", fmt.describe()).strip("-")
    out = settings.work_dir / f"{Path(source).stem}-{name}"
    if not (out / "config.json").exists():
        logger.info("making the %s checkpoint in %s", kind, out)
        quantize_checkpoint(source, out, QuantizeSettings(fmt, show_progress=False))
    return out


def load_variant(label: str, source: str, base: EngineArgs, settings: WeightsSettings) -> Variant:
    prefill_kind, _, decode_kind = label.partition("+")
    model_dir = checkpoint_for(prefill_kind, source, settings)
    decode_dir = checkpoint_for(decode_kind, source, settings) if decode_kind else None
    args = dataclasses.replace(
        base, model=str(model_dir), decode_model=str(decode_dir) if decode_dir else None
    )
    engine = LLMEngine.from_args(args)
    models = [engine.runner.model, engine.runner.decode_model]
    return Variant(
        label=label,
        engine=engine,
        checkpoint_bytes=sum(_dir_bytes(d) for d in (model_dir, decode_dir) if d is not None),
        resident_bytes=sum(resident_weight_bytes(m) for m in models if m is not None),
    )


def _dir_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


# ---- measurements ------------------------------------------------------------------------------
def measure_prefill(engine: LLMEngine, prompt: list[int]) -> float:
    """Prompt tokens per second to the first output token."""
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompt) / (time.perf_counter() - start)


def measure_decode(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens per second over the steps after every request has its first token."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    waiting = {engine.add_request(p, params) for p in prompts}
    while waiting:  # prefill (and any decode steps mixed into it), untimed
        waiting -= {out.request_id for out in engine.step() if out.new_token_ids}
    num_tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        num_tokens += sum(len(out.new_token_ids) for out in engine.step())
    return num_tokens / (time.perf_counter() - start)


def profile_step(engine: LLMEngine, prompts: list[list[int]], top: int = 8) -> list[list[str]]:
    """Where the decode steps of one wave spend their time: the top torch ops by self CPU time,
    and what no torch op accounts for (Numba kernels, e.g. the dense decode matmuls, and Python),
    as shares of the steps' wall time."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    engine.step()  # prefill, outside the profile
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
    wall_us = (time.perf_counter() - start) * 1e6
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    rows = [(e.key, e.self_cpu_time_total) for e in events[:top]]
    rows.append(
        (
            "(no torch op: Numba kernels, Python)",
            wall_us - sum(e.self_cpu_time_total for e in events),
        )
    )
    return [[name, f"{us / 1e3:.1f}", f"{100 * us / wall_us:.0f}%"] for name, us in rows]


def run_weights(settings: WeightsSettings, base: EngineArgs) -> BenchReport:
    source = base.model or default_model_path()
    variants = [load_variant(label, source, base, settings) for label in settings.formats]
    vocab_size = variants[0].engine.arch.vocab_size
    prompts = _PromptMaker(settings, vocab_size)
    for variant in variants:  # warm-up: first passes, allocator growth, kernel compilation
        measure_prefill(variant.engine, prompts.make(1, settings.prefill_len, "warmup")[0])
        measure_decode(variant.engine, prompts.make(2, settings.prompt_len, "warmup"), 3)
    points = ["prefill", *(f"c={c}" for c in settings.concurrency)]
    schedule = interleave([(p, v) for p in points for v in variants], settings.repeats)
    samples: list[dict[str, Any]] = []
    with progress(len(schedule), "bench weights") as bar:
        for repeat_idx, (point, variant) in schedule:
            samples.append(_measure(point, variant, repeat_idx, settings, prompts))
            bar.update()
            logger.info("%s %s rep %d: %.1f tok/s", variant.label, point, repeat_idx + 1,
                        samples[-1]["tok_s"])  # fmt: skip
    profiles = {v.label: profile_step(v.engine, prompts.make(1, 32, "profile")) for v in variants}
    return build_report(settings, base, variants, samples, profiles if settings.profile else {})


class _PromptMaker:
    def __init__(self, settings: WeightsSettings, vocab_size: int) -> None:
        self.settings, self.vocab_size = settings, vocab_size

    def make(self, count: int, length: int, key: str) -> list[list[int]]:
        shaped = ServingSettings(prompt_len=length, prompt_seed=self.settings.prompt_seed)
        return make_prompts(shaped, self.vocab_size, count, key)


def _measure(
    point: str, variant: Variant, repeat_idx: int, settings: WeightsSettings, prompts: _PromptMaker
) -> dict[str, Any]:
    key = f"{point}-r{repeat_idx}"  # the same prompts for every format within a repetition
    if point == "prefill":
        tok_s = measure_prefill(variant.engine, prompts.make(1, settings.prefill_len, key)[0])
        concurrency = 1
    else:
        concurrency = int(point.removeprefix("c="))
        wave = prompts.make(concurrency, settings.prompt_len, key)
        tok_s = measure_decode(variant.engine, wave, settings.output_len)
    return {"format": variant.label, "point": point, "concurrency": concurrency,
            "repeat_idx": repeat_idx, "tok_s": tok_s}  # fmt: skip


# ---- the report --------------------------------------------------------------------------------
def build_report(
    settings: WeightsSettings,
    base: EngineArgs,
    variants: list[Variant],
    samples: list[dict[str, Any]],
    profiles: dict[str, list[list[str]]],
) -> BenchReport:
    labels = [v.label for v in variants]
    points = ["prefill", *(f"c={c}" for c in settings.concurrency)]
    stats = {
        (label, point): spread(_values(samples, label, point))
        for label in labels
        for point in points
    }
    summary = [
        {
            "format": v.label,
            "checkpoint_bytes": v.checkpoint_bytes,
            "resident_weight_bytes": v.resident_bytes,
            **{p: stats[(v.label, p)] for p in points},
        }
        for v in variants
    ]
    run_settings = dataclasses.asdict(settings)
    run_settings.update(work_dir=str(settings.work_dir), engine_args=dataclasses.asdict(base))
    report = BenchReport("weights", run_settings, samples=samples, summary=summary)
    report.tables = [_size_table(variants, base.dtype), _speed_table(labels, points, stats)]
    report.tables += [
        Table(f"Profile: decode steps, {label}, c=1", ["op", "self CPU ms", "of wall time"], rows)
        for label, rows in profiles.items()
    ]
    report.plots = [_decode_plot(labels, settings.concurrency, stats)]
    report.notes = _notes(labels, settings, stats)
    return report


def _values(samples: list[dict[str, Any]], label: str, point: str) -> list[float]:
    return [s["tok_s"] for s in samples if s["format"] == label and s["point"] == point]


def _size_table(variants: list[Variant], dtype: str) -> Table:
    rows = [
        [v.label, format_bytes(v.checkpoint_bytes), format_bytes(v.resident_bytes),
         COMPUTE[v.label].format(dtype=dtype)]
        for v in variants
    ]  # fmt: skip
    return Table("Weights", ["format", "checkpoint", "resident weights", "compute"], rows)


def _speed_table(
    labels: list[str], points: list[str], stats: dict[tuple[str, str], dict[str, float]]
) -> Table:
    base = labels[0]
    rows = []
    for point in points:
        row = [point] + [format_spread(stats[(label, point)]) for label in labels]
        row += [f"{stats[(label, point)]['median'] / stats[(base, point)]['median']:.2f}x"
                for label in labels[1:]]  # fmt: skip
        rows.append(row)
    columns = ["tok/s", *labels, *(f"{label} / {base}" for label in labels[1:])]
    return Table("Throughput: median (min..max) tokens/s", columns, rows)


def _decode_plot(
    labels: list[str], concurrency: tuple[int, ...], stats: dict[tuple[str, str], dict[str, float]]
) -> LinePlot:
    series = [
        Series(
            label,
            [float(c) for c in concurrency],
            [stats[(label, f"c={c}")]["median"] for c in concurrency],
            [stats[(label, f"c={c}")]["min"] for c in concurrency],
            [stats[(label, f"c={c}")]["max"] for c in concurrency],
        )
        for label in labels
    ]
    return LinePlot("decode", "Decode throughput by weight format", "concurrency", "tok/s",
                    series, log_x=True)  # fmt: skip


def _notes(
    labels: list[str], settings: WeightsSettings, stats: dict[tuple[str, str], dict[str, float]]
) -> list[str]:
    notes = [
        f"Threads: {torch.get_num_threads()} torch threads. Every format was measured in the same "
        f"process, interleaved, {settings.repeats} repetitions per point.",
        "Expected shape (reference, FP8 vs INT4 on H200): INT4 decode faster at low concurrency, "
        "prefill slower or equal. The profile tables show where decode time goes.",
    ]
    if "bf16" in labels and "int4" in labels:
        c1 = stats[("int4", f"c={settings.concurrency[0]}")]["median"]
        ratio = c1 / stats[("bf16", f"c={settings.concurrency[0]}")]["median"]
        pre = stats[("int4", "prefill")]["median"] / stats[("bf16", "prefill")]["median"]
        notes.append(
            f"Measured: int4 / bf16 decode at c={settings.concurrency[0]} = {ratio:.2f}x, "
            f"prefill = {pre:.2f}x."
        )
    return notes
