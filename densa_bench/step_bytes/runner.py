"""`densa bench step-bytes`: how many bytes the scheduler -> runner contract costs per step.

One run of `concurrency` requests (prompt_len tokens in, output_len out) through a real engine.
Every step's SchedulerOutput is encoded with msgpack (msgspec), as it would cross a process or
host boundary, and so is the full snapshot the old contract sent for the same step: each
scheduled request's whole prompt, output so far and page table (rebuilt here from the deltas,
exactly as the runner rebuilds it). Both are measured on the same steps, side by side.
"""

from __future__ import annotations

import random
from dataclasses import asdict
from typing import Any

import msgspec

from densa.engine.hooks import StepRecord
from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams
from densa.sched.mirror import RequestStates
from densa.setup.args import EngineArgs
from densa_bench.common.report import BenchReport, LinePlot, Series, Table
from densa_bench.common.stats import percentile
from densa_bench.step_bytes.settings import StepBytesSettings


class StepBytesRecorder:
    """A step observer: bytes of each step as deltas, and as the snapshot the old contract sent."""

    def __init__(self) -> None:
        self._mirror = RequestStates()  # rebuilds the full per-request view from the deltas
        self._encoder = msgspec.msgpack.Encoder()
        self.samples: list[dict[str, Any]] = []

    def __call__(self, record: StepRecord) -> None:
        step = record.step
        snapshot = self._mirror.apply(step)  # old ScheduledRequest fields, one per request
        self.samples.append(
            {
                "step": len(self.samples),
                "requests": len(step.scheduled),
                "tokens": step.num_scheduled_tokens,
                "delta_bytes": len(self._encoder.encode(step)),
                "snapshot_bytes": len(self._encoder.encode(_snapshot(step, snapshot))),
            }
        )


def _snapshot(step: Any, items: list[Any]) -> dict[str, Any]:
    """The old contract's message for this step: whole views, plus the same step-level fields."""
    return {
        "scheduled": items,
        "tag_updates": step.tag_updates,
        "finished_request_ids": step.finished_request_ids,
        "preempted_request_ids": step.preempted_request_ids,
        "new_request_ids": step.new_request_ids,
    }


def run_step_bytes(settings: StepBytesSettings, engine_args: EngineArgs) -> BenchReport:
    engine = LLMEngine.from_args(engine_args)
    recorder = StepBytesRecorder()
    engine.observers.add(recorder)
    rng = random.Random(settings.seed)
    vocab = engine.arch.vocab_size
    params = SamplingParams(temperature=0, max_tokens=settings.output_len, ignore_eos=True)
    for _ in range(settings.concurrency):
        engine.add_request([rng.randrange(100, vocab) for _ in range(settings.prompt_len)], params)
    while engine.has_unfinished_requests():
        engine.step()
    return _report(settings, engine_args, recorder.samples)


def _report(
    settings: StepBytesSettings, engine_args: EngineArgs, samples: list[dict[str, Any]]
) -> BenchReport:
    full = [s for s in samples if s["requests"] == settings.concurrency]  # every request running
    decode = [s for s in full if s["tokens"] == settings.concurrency]  # all-decode steps
    summary = [_summary(name, group) for name, group in (("all steps", samples),
               ("all-decode steps at full concurrency", decode))]  # fmt: skip
    report = BenchReport(
        name="step_bytes",
        settings={**asdict(settings), "engine": asdict(engine_args)},
        samples=samples,
        summary=summary,
        notes=NOTES,
    )
    report.tables = [_table(summary)]
    report.plots = [_plot(samples)]
    return report


def _summary(name: str, group: list[dict[str, Any]]) -> dict[str, Any]:
    delta = [float(s["delta_bytes"]) for s in group]
    snapshot = [float(s["snapshot_bytes"]) for s in group]
    return {
        "steps": name,
        "count": len(group),
        "delta_bytes_median": percentile(delta, 50) if delta else 0.0,
        "snapshot_bytes_median": percentile(snapshot, 50) if snapshot else 0.0,
        "delta_bytes_total": sum(delta),
        "snapshot_bytes_total": sum(snapshot),
    }


def _table(summary: list[dict[str, Any]]) -> Table:
    rows = []
    for s in summary:
        ratio = s["snapshot_bytes_total"] / max(s["delta_bytes_total"], 1.0)
        rows.append([s["steps"], str(s["count"]), f"{s['snapshot_bytes_median']:,.0f}",
                     f"{s['delta_bytes_median']:,.0f}", f"{ratio:.1f}x"])  # fmt: skip
    columns = ["steps", "count", "snapshot B/step (median)", "deltas B/step (median)", "saved"]
    return Table("Scheduler -> runner message size", columns, rows)


def _plot(samples: list[dict[str, Any]]) -> LinePlot:
    steps = [float(s["step"]) for s in samples]
    return LinePlot(
        name="bytes_per_step",
        title="Bytes per step: whole snapshots vs deltas",
        x_label="engine step",
        y_label="bytes (msgpack)",
        series=[
            Series("snapshot (old contract)", steps, [float(s["snapshot_bytes"]) for s in samples]),
            Series("deltas", steps, [float(s["delta_bytes"]) for s in samples]),
        ],
    )


NOTES = [
    "Both encodings are msgpack (msgspec) of the same steps of one run: 'deltas' is the "
    "SchedulerOutput the engine really sends; 'snapshot' is what the previous contract sent for "
    "that step (each scheduled request's whole prompt, output and page table, re-sent every step), "
    "rebuilt from the deltas exactly as the runner rebuilds it.",
    "A snapshot grows with the context (O(prompt + output) per request per step); a delta "
    "step carries the new tokens, newly mapped pages and tag changes (O(new tokens)).",
]
