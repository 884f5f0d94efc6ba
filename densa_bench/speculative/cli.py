"""`densa bench speculative`: the command line, and turning its options into a run. Building the
parser imports no torch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from densa_bench.common.benchmark import write_report
from densa_bench.peers.cli import find_llama_server


def add_speculative_parser(benchmarks: argparse._SubParsersAction) -> None:
    from densa_bench.speculative.runner import DEFAULT_METHODS, METHODS, WORKLOADS

    parser = benchmarks.add_parser(
        "speculative",
        help="speculative decoding (off / ngram / draft) vs llama-server with the same draft",
        description="Starts densa without speculation, with prompt lookup and with a draft "
        "model, and llama-server with the same draft (-md), each its own server; sends the "
        "same code-edit and chat requests to each, interleaved; reports output tok/s, TPOT, "
        "acceptance and the issue's goals.",
    )
    g = parser.add_argument_group("benchmark")
    g.add_argument("--model", default=None, help="the target GGUF or catalog name "
                   "(default: the bundled SmolLM2)")  # fmt: skip
    g.add_argument("--draft-model", default=None, help="the draft GGUF or catalog name "
                   "(default: the target itself)")  # fmt: skip
    g.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS))
    g.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 32])
    g.add_argument("--prompt-len", type=int, default=320, help="file / passage tokens")
    g.add_argument("--output-len", type=int, default=64, help="output tokens (EOS ignored)")
    g.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="k (llama-server: --spec-draft-n-max)"
    )
    g.add_argument("--repeats", type=int, default=1)
    g.add_argument("--warmup", type=int, default=1)
    g.add_argument("--prompt-seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=None, help="per server (default: all CPUs)")
    g.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start no wave after this long (the report says which ran)")  # fmt: skip
    g.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's server binary")
    g.add_argument("--out", type=Path, default=Path("docs/benchmarks/speculative"))
    parser.set_defaults(handler=_speculative)


def _speculative(ns: argparse.Namespace) -> int:
    from densa.quant.calibration_data import lambada_passages
    from densa.text.tokenizer import Tokenizer
    from densa_bench.speculative.report import build_report
    from densa_bench.speculative.runner import SpecPrompts, SpecWave, run_speculative

    try:
        settings, specs, (gguf, draft, hf_dir) = _plan(ns)
    except (ValueError, OSError) as exc:
        print(f"densa bench speculative: {exc}", file=sys.stderr)
        return 2
    tokenizer = Tokenizer.from_dir(hf_dir)
    prompts = SpecPrompts(
        lambda text: tokenizer.render_chat([{"role": "user", "content": text}]),
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        lambada_passages() if "chat" in settings.workloads else [],
        settings,
    )
    extra: dict[str, Any] = {"model": str(gguf), "draft_model": str(draft)}
    so_far: list[tuple[list[SpecWave], dict[str, dict[str, Any]]]] = []

    def write_so_far(waves: list[SpecWave], variants: dict[str, dict[str, Any]]) -> None:
        so_far[:] = [(list(waves), variants)]
        partial = build_report(waves, variants, {**_as_dict(settings), **extra, "partial": True})
        partial.plots = []  # JSON and Markdown only until the run ends
        partial.write(ns.out)

    try:
        waves, variants = run_speculative(specs, settings, prompts, ns.out / "logs", write_so_far)
    except KeyboardInterrupt:  # cut short (e.g. `timeout -s INT`): report what was measured
        if not so_far:
            raise
        (waves, variants), extra["partial"] = so_far[0], "interrupted; the waves measured so far"
    planned = settings.repeats * len(settings.concurrency) * len(settings.workloads) * len(specs)
    if len(waves) < planned and "partial" not in extra:
        extra["partial"] = f"time budget spent: {len(waves)} of {planned} waves ran"
    return write_report(build_report(waves, variants, {**_as_dict(settings), **extra}), ns.out)


def _plan(ns: argparse.Namespace) -> tuple[Any, list[Any], tuple[Path, Path, Path]]:
    """The settings, the server variants and (model, draft, HF directory) from the options;
    ValueError or OSError when they do not make a run."""
    from densa.model.catalog import resolve_model_arg
    from densa.model.loader import resolve_model_dir
    from densa.setup.args import default_model_path
    from densa.utils.cpu import usable_cpus
    from densa_bench.peers.specs import PeerContext
    from densa_bench.speculative.runner import SpecBenchSettings, build_variants

    settings = SpecBenchSettings(
        concurrency=tuple(ns.concurrency), workloads=tuple(ns.workloads),
        methods=tuple(ns.methods), prompt_len=ns.prompt_len, output_len=ns.output_len,
        num_speculative_tokens=ns.num_speculative_tokens, repeats=ns.repeats,
        warmup=ns.warmup, prompt_seed=ns.prompt_seed, threads=ns.threads or usable_cpus(),
        time_budget_s=ns.time_budget,
    )  # fmt: skip
    gguf = Path(resolve_model_arg(ns.model) if ns.model else default_model_path())
    draft = Path(resolve_model_arg(ns.draft_model)) if ns.draft_model else gguf
    hf_dir = resolve_model_dir(str(gguf))
    ctx = PeerContext(
        gguf=gguf, hf_dir=hf_dir, llama_server=find_llama_server(ns.llama_server),
        threads=settings.threads, max_concurrency=max(settings.concurrency),
        # the chat template and the ask add ~60 tokens; a code cut ends at a line
        context_len=settings.prompt_len + settings.output_len + 256,
        output_len=settings.output_len,
    )  # fmt: skip
    return settings, build_variants(settings, ctx, draft), (gguf, draft, hf_dir)


def _as_dict(settings: object) -> dict[str, object]:
    from dataclasses import asdict, is_dataclass

    assert is_dataclass(settings) and not isinstance(settings, type)
    return asdict(settings)
