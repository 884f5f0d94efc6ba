"""Turn the GPU check's JSON into docs/benchmarks/gpu/<date>/: README.md (tables) and PNG plots.

    python -m densa_bench.gpu.report gpu_check.json [--out docs/benchmarks/gpu]

Writes <out>/<date of the run>/README.md, results.json (a copy) and, when matplotlib is
installed, throughput-vs-concurrency plots per comparison. End-to-end figures are medians over
the repeats; ratios compare runs made side by side in the one process.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

# comparison -> (baseline engine, compressed / changed engine, what differs)
COMPARISONS = {
    "kv": ("kv_bf16", "kv_fp8", "BF16 vs FP8 KV pages, one KV budget in bytes"),
    "weights": ("base", "int4", "BF16 vs INT4 (g128) weights"),
    "integrity": ("base", "integrity_off", "KV page integrity checks on vs off"),
}
METRICS = ("output_tok_s", "decode_tok_s", "ttft_ms_p50", "tpot_ms_mean", "max_decode_batch",
           "preemptions")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m densa_bench.gpu.report", description=__doc__)
    parser.add_argument("results", type=Path, help="gpu_check.json")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/gpu"))
    args = parser.parse_args(argv)
    folder = write_report(json.loads(args.results.read_text()), args.out, args.results)
    print(f"[gpu_report] wrote {folder}")
    return 0


def write_report(results: dict[str, Any], out: Path, source: Path | None = None) -> Path:
    folder = out / results["meta"]["date"]
    folder.mkdir(parents=True, exist_ok=True)
    if source is not None:
        shutil.copyfile(source, folder / "results.json")
    plots = _plots(results, folder)
    (folder / "README.md").write_text(render(results, plots))
    return folder


def render(results: dict[str, Any], plots: list[str] | None = None) -> str:
    meta = results["meta"]
    lines = [f"# GPU check, {meta['date']}", ""]
    if meta.get("dry_run"):
        lines += ["**Dry run on a CPU (Triton interpreter): its times are not measurements.**", ""]
    lines += [
        f"Machine: {meta.get('gpu') or meta.get('cpu')}; torch {meta['torch']}, "
        f"triton {meta.get('triton')}, CUDA {meta.get('cuda')}. Copy bandwidth measured "
        f"{meta.get('copy_bandwidth_gbs', 0):.0f} GB/s; roofline used "
        f"{meta.get('roofline_gbs', 0):.0f} GB/s. Run took {meta.get('elapsed_s', 0):.0f} s "
        f"of a {meta['time_budget_s']:.0f} s budget. Command: `{meta['command']}`",
        "",
        *_correctness(results["correctness"]),
        *_kernels(results["kernels"]),
        *_e2e(results.get("e2e")),
    ]
    for name in plots or []:
        lines += [f"![{name}]({name})", ""]
    if results["skipped"]:
        lines += ["## Skipped (time budget)", "", *[f"- {s}" for s in results["skipped"]], ""]
    if results["errors"]:
        lines += ["## Errors", ""]
        lines += [f"- {e['section']}: `{e['error']}`" for e in results["errors"]] + [""]
    return "\n".join(lines)


def _correctness(checks: list[dict[str, Any]]) -> list[str]:
    if not checks:
        return []
    rows = ["## Kernels against their torch references", "",
            "| kernel | case | max abs error | max abs reference | ok |",
            "|---|---|---|---|---|"]  # fmt: skip
    for c in checks:
        error = c.get("max_abs_err")
        rows.append(
            f"| {c['kernel']} | {c['case']} | {_num(error)} | {_num(c.get('max_abs_ref'))} | "
            f"{'yes' if c['ok'] else '**NO**'} |"
        )
    return [*rows, ""]


def _kernels(timings: list[dict[str, Any]]) -> list[str]:
    if not timings:
        return []
    rows = ["## Kernel timings against the HBM roofline", "",
            "| kernel | shape | time | GB/s | of roofline | goal | vs dense bf16 / torch path |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for t in timings:
        if "host_us" in t:
            rows.append(f"| {t['kernel']} | {t['shape']} | {t['host_us']:.0f} µs (host) | | | | |")
            continue
        goal = t.get("goal")
        verdict = (
            ""
            if goal is None
            else f"{goal:.0%} ({'met' if t['roofline_frac'] >= goal else '**not met**'})"
        )
        other = ""
        if t.get("speedup_vs_dense") is not None:
            other = f"{t['speedup_vs_dense']:.2f}x faster"
        elif t.get("torch_gather_ms") is not None:
            other = f"gather+dequantize alone {t['torch_gather_ms']:.3f} ms"
        rows.append(
            f"| {t['kernel']} | {t['shape']} | {t['ms']:.3f} ms | {t['gbs']:.0f} | "
            f"{t['roofline_frac']:.0%} | {verdict} | {other} |"
        )
    return [*rows, ""]


def medians(runs: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, float | None]]:
    """(variant, concurrency) -> the median of each metric over that cell's repeats."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        cells[(run["variant"], run["concurrency"])].append(run)
    out: dict[tuple[str, int], dict[str, float | None]] = {}
    for key, group in cells.items():
        out[key] = {}
        for metric in METRICS:
            values = [r[metric] for r in group if r.get(metric) is not None]
            out[key][metric] = statistics.median(values) if values else None
    return out


def _e2e(e2e: dict[str, Any] | None) -> list[str]:
    if not e2e or not e2e.get("runs"):
        return []
    model, settings = e2e.get("model", {}), e2e["settings"]
    lines = [
        "## End to end",
        "",
        f"Random-weight Llama, {model.get('parameters', 0) / 1e9:.2f}B parameters "
        f"({model.get('num_layers')} layers, hidden {model.get('hidden_size')}, "
        f"{model.get('num_heads')}/{model.get('num_kv_heads')} heads); prompts of "
        f"{settings['prompt_len']} random tokens, {settings['output_len']} output tokens, EOS "
        f"ignored; {settings['repeats']} interleaved repeats, medians.",
        "",
        "| engine | KV pages | whole requests that fit | build + warm-up | CUDA graphs |",
        "|---|---|---|---|---|",
    ]
    for name, e in e2e["engines"].items():
        lines.append(f"| {name} | {e['num_pages']} | {e['fits_requests']} | "
                     f"{e['build_and_warmup_s']:.1f} s | {e['cuda_graphs']} |")  # fmt: skip
    lines.append("")
    cells = medians(e2e["runs"])
    for base, other, title in COMPARISONS.values():
        levels = sorted({c for (v, c) in cells if v in (base, other)})
        if not levels:
            continue
        lines += [f"### {title}", "",
                  f"| c | {base} output tok/s | {other} output tok/s | ratio | {base} decode "
                  f"tok/s | {other} decode tok/s | {base} TPOT ms | {other} TPOT ms | "
                  f"{base} / {other} max decode batch | preemptions |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for c in levels:
            a, b = cells.get((base, c), {}), cells.get((other, c), {})
            ratio = _ratio(b.get("output_tok_s"), a.get("output_tok_s"))
            lines.append(
                f"| {c} | {_num(a.get('output_tok_s'))} | {_num(b.get('output_tok_s'))} "
                f"| {ratio} | "
                f"{_num(a.get('decode_tok_s'))} | {_num(b.get('decode_tok_s'))} | "
                f"{_num(a.get('tpot_ms_mean'))} | {_num(b.get('tpot_ms_mean'))} | "
                f"{_num(a.get('max_decode_batch'))} / {_num(b.get('max_decode_batch'))} | "
                f"{_num(a.get('preemptions'))} / {_num(b.get('preemptions'))} |"
            )
        lines.append("")
    return lines


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "—"


def _num(value: float | None) -> str:
    if value is None:
        return "—"
    if abs(value) >= 100 or float(value).is_integer():
        return f"{value:.0f}"
    return f"{value:.3g}"


def _plots(results: dict[str, Any], folder: Path) -> list[str]:
    """Output tok/s vs concurrency per comparison (skipped without matplotlib)."""
    e2e = results.get("e2e")
    if not e2e or not e2e.get("runs"):
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[gpu_report] matplotlib missing: no plots", file=sys.stderr)
        return []
    cells = medians(e2e["runs"])
    names = []
    for experiment, (base, other, title) in COMPARISONS.items():
        name = f"{experiment}.png"
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for variant in (base, other):
            points = sorted((c, m["output_tok_s"]) for (v, c), m in cells.items() if v == variant)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=variant)
        ax.set(xlabel="concurrent requests", ylabel="output tok/s", title=title)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names


if __name__ == "__main__":
    sys.exit(main())
