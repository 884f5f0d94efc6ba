"""The H200 check's driver (scripts/gpu_check.sh runs it): kernel correctness against the torch
references, kernel timings against the HBM roofline, and the end-to-end sweep (gpu/e2e.py), all
written to one JSON file that `python -m densa_bench.gpu.report` turns into tables and plots under
docs/benchmarks/gpu/<date>/.

    python -m densa_bench.gpu.check --out DIR [--time-budget 420] [--dry-run]

--dry-run runs every section on the CPU with tiny shapes, the kernels in Triton's interpreter:
what the test suite does, so the script cannot rot on machines without a GPU. Its times are not
measurements.

What it imports is kept to what the check machine has (torch, triton, transformers, numpy,
safetensors, tokenizers, psutil, numba): no serving stack. A test walks the imports to hold that.
The time budget is checked before every section and wave; what did not fit is listed as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS_FILE = "gpu_check.json"
# Third-party modules the check machine's image provides (see docs/benchmarks/gpu/README.md).
CHECK_MACHINE_MODULES = frozenset(
    {"torch", "triton", "numpy", "transformers", "safetensors", "tokenizers", "psutil", "numba",
     "llvmlite", "tqdm", "huggingface_hub", "matplotlib", "yaml", "jinja2"}
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m densa_bench.gpu.check", description=__doc__)
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json")
    parser.add_argument("--time-budget", type=float, default=420.0, help="seconds in all")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, interpreter")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--workdir", type=Path, default=None, help="for the random checkpoint")
    args = parser.parse_args(argv)
    if args.dry_run:
        # Before anything imports Triton: it decides at import and decoration time.
        os.environ["TRITON_INTERPRET"] = "1"
    results = run_check(args)
    failed = [c for c in results["correctness"] if not c.get("ok")]
    print(f"[gpu_check] wrote {args.out / RESULTS_FILE}: {len(results['correctness'])} checks, "
          f"{len(failed)} failed, {len(results['errors'])} errors, "
          f"{len(results['skipped'])} skipped, {results['meta']['elapsed_s']:.0f} s")  # fmt: skip
    return 1 if failed or results["errors"] else 0


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    start = time.monotonic()

    def time_left() -> float:
        return args.time_budget - (time.monotonic() - start)

    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("[gpu_check] no CUDA device: run with --dry-run on a CPU")
    results: dict[str, Any] = {
        "meta": describe(device, args),
        "correctness": [],
        "kernels": [],
        "e2e": None,
        "skipped": [],
        "errors": [],
    }
    sections = [("bandwidth", lambda: _bandwidth(results, device, args.dry_run))]
    if not args.skip_kernels:
        sections.append(("kernels", lambda: _kernels(results, device, args.dry_run, time_left)))
    if not args.skip_e2e:
        sections.append(("e2e", lambda: _e2e(results, args, time_left)))
    for name, run in sections:
        _section(results, name, run)
        # Saved after every part: a run stopped from outside still leaves what it measured.
        results["meta"]["elapsed_s"] = time.monotonic() - start
        save(results, args.out)
    return results


def save(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS_FILE).write_text(json.dumps(results, indent=2, default=str) + "\n")


def describe(device: Any, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    meta: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "dry_run": args.dry_run,
        "time_budget_s": args.time_budget,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": " ".join([Path(sys.executable).name, "-m", "densa_bench.gpu.check",
                             *sys.argv[1:]]),
    }  # fmt: skip
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update(gpu=props.name, multiprocessors=props.multi_processor_count,
                    memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda)  # fmt: skip
    else:
        meta.update(gpu=None, cpu=platform.processor() or platform.machine())
    return meta


def _section(results: dict[str, Any], name: str, run: Callable[[], None]) -> None:
    """Run one part; an exception is recorded (with its traceback) and the next part runs."""
    try:
        run()
    except Exception as exc:
        results["errors"].append({"section": name, "error": repr(exc),
                                  "traceback": traceback.format_exc()})  # fmt: skip
        print(f"[gpu_check] {name} failed: {exc!r}", file=sys.stderr)


def _bandwidth(results: dict[str, Any], device: Any, dry_run: bool) -> None:
    from densa_bench.gpu.timing import ROOFLINE_GBS, copy_bandwidth_gbs

    nbytes = (1 << 20) if dry_run else (4 << 30)
    results["meta"]["copy_bandwidth_gbs"] = copy_bandwidth_gbs(device, nbytes)
    results["meta"]["roofline_gbs"] = ROOFLINE_GBS


def _kernels(results: dict[str, Any], device: Any, dry_run: bool, time_left: Any) -> None:
    from densa.kernels.triton.tuning import chosen_configs
    from densa_bench.gpu.kernels import run_kernel_checks
    from densa_bench.gpu.timing import Sizes

    sizes = Sizes.tiny() if dry_run else Sizes.h200()
    kernel_results = run_kernel_checks(sizes, device, time_left)
    results["correctness"] += kernel_results.correctness
    results["kernels"] += kernel_results.timings
    results["skipped"] += kernel_results.skipped
    results["meta"]["matmul_configs"] = {
        " ".join(map(str, key)): config.describe() for key, config in chosen_configs().items()
    }
    for check in kernel_results.correctness:
        print(f"[gpu_check] {'ok  ' if check['ok'] else 'FAIL'} {check['kernel']} {check['case']}")


def _e2e(results: dict[str, Any], args: argparse.Namespace, time_left: Any) -> None:
    import torch

    from densa.formats.kv_format import KVFormat
    from densa.model.arch import ArchConfig
    from densa.model.kv_pages import bytes_per_token
    from densa_bench.gpu.e2e import E2ESettings, baseline_kv_dtype, run_sweep
    from densa_bench.gpu.model import TINY, RandomLlama, write_random_llama

    settings = E2ESettings.tiny() if args.dry_run else E2ESettings()
    shape = TINY if args.dry_run else RandomLlama()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="densa-gpu-check-"))
    start = time.monotonic()
    model_dir = write_random_llama(workdir / "random-llama", shape, torch.device(settings.device))
    write_s = time.monotonic() - start
    arch = ArchConfig.from_dir(model_dir)
    per_token = bytes_per_token(arch, KVFormat.of(baseline_kv_dtype(settings)))
    info, skipped = run_sweep(
        model_dir, settings, shape.vocab_size, per_token,
        time_left,
        log=lambda line: print(f"[gpu_check] {line}", flush=True),
    )  # fmt: skip
    info["model"] = {**asdict(shape), "parameters": shape.num_parameters,
                     "write_s": write_s}  # fmt: skip
    results["e2e"] = info
    results["skipped"] += skipped


if __name__ == "__main__":
    sys.exit(main())
