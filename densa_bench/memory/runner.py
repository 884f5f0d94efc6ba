"""`densa bench memory`: the peak RSS of a densa server over its whole life, load included.

`densa bench peers` resets each process's high-water mark after start, so its figure is the
wave's alone; issue 21's bound is on the whole life. Here nothing is reset: the server is
started as `densa bench peers` starts it (same arguments, same KV budget), a thread samples the
RSS of every process of its tree every few tens of milliseconds from the first instant, waves
run, and before stopping each process's own high-water mark (VmHWM: the kernel's, exact) and
the make-up of its memory (smaps_rollup: anonymous vs file-backed) are read.

Two figures, because the processes do not peak at the same moment: the sum of the per-process
high-water marks (an upper bound, what `densa bench peers` reports) and the largest sum of RSS
seen at one sample (a lower bound on the true simultaneous peak).
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

from densa_bench.common.openai_load import run_wave
from densa_bench.common.report import BenchReport, Table
from densa_bench.memory.settings import FILE_FACTOR, RUNTIME_ALLOWANCE_MIB, MemorySettings
from densa_bench.peers.runner import PeersSettings, PromptMaker
from densa_bench.peers.servers import PeerServer, status_kib
from densa_bench.peers.specs import PeerContext, build_specs

MIB = 2**20
_ROLLUP_FIELDS = ("Rss", "Anonymous", "Shmem", "AnonHugePages")


class RssSampler:
    """A thread recording (seconds since start, phase, {pid: RSS bytes}) of a server's tree."""

    def __init__(self, server: PeerServer, interval_s: float) -> None:
        self.server, self.interval_s = server, interval_s
        self.phase = "load"
        self.samples: list[tuple[float, str, dict[int, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._start_s = time.perf_counter()

    def start(self) -> None:
        self._start_s = time.perf_counter()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.server.process is not None:
                rss = {pid: status_kib(pid, "VmRSS") * 1024 for pid in self.server.process_ids()}
                self.samples.append((time.perf_counter() - self._start_s, self.phase, rss))
            self._stop.wait(self.interval_s)

    def peak(self, phase: str | None = None) -> tuple[int, float]:
        """The largest sum of RSS over the tree at one sample (of `phase`, or any), and when."""
        best, when = 0, 0.0
        for t, sample_phase, rss in self.samples:
            if phase in (None, sample_phase) and sum(rss.values()) > best:
                best, when = sum(rss.values()), t
        return best, when


def run_memory(settings: MemorySettings, out: Path) -> BenchReport:
    ctx = _context(settings)
    spec = build_specs([settings.peer], ctx)[0]
    prompts = _prompts(ctx, settings)
    server = PeerServer(spec, out / "logs")
    sampler = RssSampler(server, settings.sample_interval_s)
    processes: dict[int, dict[str, Any]] = {}
    try:
        sampler.start()
        started = time.perf_counter()
        server.start()  # the sampler sees the tree from the first poll after Popen
        load_s = time.perf_counter() - started
        after_load = _read_processes(server, "load")
        for wave_idx in range(settings.waves):
            sampler.phase = f"wave {wave_idx + 1}"
            batch = prompts.prompts(settings.concurrency, f"memory{wave_idx}")
            run_wave(server.endpoint, batch, settings.output_len)
        processes = _read_processes(server, "whole life")
        _merge_load_marks(processes, after_load)
    finally:
        sampler.stop()
        server.stop()
    bound = _bound_bytes(ctx)
    return _report(settings, ctx, spec.argv, processes, sampler, load_s, bound)


def _context(settings: MemorySettings) -> PeerContext:
    from densa.model.catalog import resolve_model_arg
    from densa.model.loader import resolve_model_dir

    gguf = Path(resolve_model_arg(settings.model))
    return PeerContext(
        gguf=gguf, hf_dir=resolve_model_dir(str(gguf)), llama_server=None, threads=_threads(),
        max_concurrency=settings.concurrency,
        context_len=settings.prompt_len + settings.output_len + 64,  # as `densa bench peers`
        output_len=settings.output_len,
    )  # fmt: skip


def _threads() -> int:
    from densa.utils.cpu import usable_cpus

    return usable_cpus()


def _prompts(ctx: PeerContext, settings: MemorySettings) -> PromptMaker:
    from densa.quant.calibration_data import lambada_passages
    from densa.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(ctx.hf_dir)
    peers = PeersSettings(
        concurrency=(settings.concurrency,), prompt_len=settings.prompt_len,
        output_len=settings.output_len,
    )  # fmt: skip
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return PromptMaker(lambada_passages(), encode, tokenizer.decode, peers)


def _bound_bytes(ctx: PeerContext) -> int:
    """Issue 21: file size x 1.25 + the KV budget + the runtime allowance."""
    kv_bytes = -(-ctx.llama_kv_bytes // MIB) * MIB  # what `--kv-cache-memory` is given
    return int(ctx.gguf.stat().st_size * FILE_FACTOR) + kv_bytes + RUNTIME_ALLOWANCE_MIB * MIB


def _read_processes(server: PeerServer, label: str) -> dict[int, dict[str, Any]]:
    """Per process of the tree now: its role, its high-water mark, its RSS make-up."""
    front = server.process.pid if server.process is not None else -1
    found = {}
    for pid in server.process_ids():
        found[pid] = {
            "pid": pid,
            "role": "HTTP front" if pid == front else _command_name(pid),
            f"{label} peak": status_kib(pid, "VmHWM") * 1024,
            f"{label} rollup": smaps_rollup(pid),
        }
    return found


def _merge_load_marks(processes: dict[int, dict[str, Any]], after_load: dict[int, Any]) -> None:
    for pid, entry in processes.items():
        if pid in after_load:
            entry["load peak"] = after_load[pid]["load peak"]
            entry["load rollup"] = after_load[pid]["load rollup"]


def _command_name(pid: int) -> str:
    with contextlib.suppress(OSError):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"densa.engine.core_process" in argv:
            return "engine core"
        return "child: " + b" ".join(argv[:3]).decode(errors="replace")[:60]
    return "child"


def smaps_rollup(pid: int) -> dict[str, int]:
    """The process's RSS split by kind, bytes (/proc/PID/smaps_rollup; {} where unreadable)."""
    values: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in _ROLLUP_FIELDS:
                values[key] = int(rest.split()[0]) * 1024
    if "Rss" in values:
        values["file-backed"] = values["Rss"] - values.get("Anonymous", 0) - values.get("Shmem", 0)
    return values


# ---- the report ------------------------------------------------------------------------------
def _report(
    settings: MemorySettings,
    ctx: PeerContext,
    argv: tuple[str, ...],
    processes: dict[int, dict[str, Any]],
    sampler: RssSampler,
    load_s: float,
    bound: int,
) -> BenchReport:
    hwm_sum = sum(p["whole life peak"] for p in processes.values())
    load_sum = sum(p.get("load peak", 0) for p in processes.values())
    together, when = sampler.peak()
    summary = {
        "bound_bytes": bound,
        "sum_of_process_peaks_bytes": hwm_sum,
        "sum_of_process_peaks_after_load_bytes": load_sum,
        "largest_sampled_sum_bytes": together,
        "largest_sampled_sum_at_s": when,
        "load_s": load_s,
        "within_bound": hwm_sum <= bound,
        "margin_bytes": bound - hwm_sum,
        "file_bytes": ctx.gguf.stat().st_size,
        "kv_budget_bytes": -(-ctx.llama_kv_bytes // MIB) * MIB,
    }
    report = BenchReport(
        name="memory",
        settings={**vars(settings), "command": " ".join(argv)},
        samples=changes(sampler.samples),
        summary=[summary, *processes.values()],
        notes=NOTES,
    )
    report.tables = [_bound_table(summary), _process_table(processes)]
    return report


def changes(
    samples: list[tuple[float, str, dict[int, int]]], step: int = MIB
) -> list[dict[str, Any]]:
    """The samples worth keeping: the first, and each where a process's RSS moved by `step`
    or more since the last kept one, or the phase changed (an idle server repeats itself)."""
    kept: list[dict[str, Any]] = []
    for t, phase, rss in samples:
        last = kept[-1] if kept else None
        if (
            last is None
            or last["phase"] != phase
            or rss.keys() != last["rss"].keys()
            or any(abs(v - last["rss"][pid]) >= step for pid, v in rss.items())
        ):
            kept.append({"s": round(t, 3), "phase": phase, "rss": rss})
    return kept


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / MIB:,.0f} MiB"


def _bound_table(s: dict[str, Any]) -> Table:
    rows = [
        ["bound: file x 1.25 + KV + 400 MiB",
         f"{_mib(s['file_bytes'])} x {FILE_FACTOR} + {_mib(s['kv_budget_bytes'])} + "
         f"{RUNTIME_ALLOWANCE_MIB} MiB = {_mib(s['bound_bytes'])}"],
        ["sum of the processes' peaks, whole life", _mib(s["sum_of_process_peaks_bytes"])],
        ["... of which reached by the end of the load",
         _mib(s["sum_of_process_peaks_after_load_bytes"])],
        ["largest sum at one sample", f"{_mib(s['largest_sampled_sum_bytes'])} at "
         f"{s['largest_sampled_sum_at_s']:.1f} s"],
        ["margin (bound - sum of peaks)", _mib(s["margin_bytes"])],
        ["within the bound", "yes" if s["within_bound"] else "**no**"],
        ["start-up (until /v1/models answers)", f"{s['load_s']:.1f} s"],
    ]  # fmt: skip
    return Table("Whole-life peak RSS vs issue 21's bound", ["", ""], rows)


def _process_table(processes: dict[int, dict[str, Any]]) -> Table:
    rows = []
    for p in processes.values():
        rollup = p["whole life rollup"]
        rows.append([
            p["role"], _mib(p.get("load peak", 0)), _mib(p["whole life peak"]),
            _mib(rollup.get("Rss", 0)), _mib(rollup.get("Anonymous", 0)),
            _mib(rollup.get("AnonHugePages", 0)), _mib(rollup.get("file-backed", 0)),
        ])  # fmt: skip
    columns = ["process", "peak by end of load", "peak, whole life", "RSS at end",
               "anonymous", "of it huge pages", "file-backed"]  # fmt: skip
    return Table("Per process (VmHWM; make-up at the end from smaps_rollup)", columns, rows)


NOTES = [
    "Nothing is reset: each process's VmHWM is its peak since it started, the load included "
    "(`densa bench peers` resets it after start, so its peak RSS is the waves' alone).",
    "The sum of per-process peaks is an upper bound on what the tree held at once (the front "
    "and the engine peak at different moments); the largest sampled sum is a lower bound "
    "(a peak shorter than the sampling interval can fall between samples).",
    "file-backed = Rss - Anonymous - Shmem: mapped files (the GGUF while it is read, shared "
    "libraries); they count in RSS while mapped.",
    "samples: the RSS of each process (bytes, by pid) whenever one moved by 1 MiB or more.",
]
