"""The `densa eval` command: compare numeric formats. Building the parser imports no torch.

Every sub-command takes the engine options (`--model`, `--kv-cache-memory`, ...) as the base all
formats share, then `--ref SPEC` and one or more `--test SPEC`, each `[label:]key=value,...`
over EngineArgs fields, e.g.

    densa eval distribution --test "fp8:kv_cache_dtype=fp8_e4m3"
    densa eval choice --ref "kv_cache_dtype=bfloat16" --test "int4:model=/ckpt/int4-g64"
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from densa.quant.calibration_data import data_root
from densa.setup.args import EngineArgs
from densa_bench.common.data import TASKS
from densa_bench.eval.formats import Format, parse_format

# A fixed KV budget, not a fraction of free memory: every format's engine loads into one process,
# and a fraction would leave the later ones less. 512 MiB holds ~11k fp32 SmolLM2-135M tokens.
EVAL_KV_CACHE_MEMORY = "512MiB"


def add_eval_parser(commands: argparse._SubParsersAction) -> None:
    """Add `densa eval` with one sub-command per evaluation to the `densa` sub-commands."""
    parser = commands.add_parser(
        "eval",
        help="compare numeric formats (KV cache, weights) against a reference, with 95%% CIs",
        description="Quality evaluations: results go to docs/eval/<name>/ as JSON, Markdown "
        "and PNG. See docs/quality.md.",
    )
    evaluations = parser.add_subparsers(title="evaluations", metavar="EVALUATION")
    _add_distribution(evaluations)
    _add_split(evaluations)
    _add_choice(evaluations)
    _add_greedy(evaluations)
    _add_gsm8k(evaluations)
    _add_tools(evaluations)
    _add_long_context(evaluations)
    parser.set_defaults(handler=lambda ns: _print_help(parser))


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _add_common(
    parser: argparse.ArgumentParser,
    name: str,
    handler: Callable[..., int],
    tests_required: bool = True,
    test_help: str = "a format to compare with the reference (repeat for several)",
) -> None:
    g = parser.add_argument_group("formats")
    g.add_argument(
        "--ref",
        default="",
        metavar="SPEC",
        help="the reference format: [label:]key=value,... over engine options (default: the "
        "engine options as given)",
    )
    g.add_argument("--test", action="append", required=tests_required, default=[],
                   metavar="SPEC", help=test_help)  # fmt: skip
    g.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    g.add_argument("--bootstrap-seed", type=int, default=0)
    g.add_argument("--out", type=Path, default=Path("docs/eval") / name, help="output folder")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=handler, kv_cache_memory=EVAL_KV_CACHE_MEMORY)


def _add_distribution(evaluations: argparse._SubParsersAction) -> None:
    parser = evaluations.add_parser(
        "distribution",
        help="KL divergence, top-1 agreement and perplexity on English text",
        description="Teacher-forced next-token distributions on LAMBADA passages: mean "
        "KL(ref||test), top-1 agreement and perplexity, with segment-bootstrap 95% CIs.",
    )
    g = parser.add_argument_group("evaluation")
    g.add_argument("--tokens", type=int, default=20480, help="tokens of text (whole segments)")
    g.add_argument("--segment-len", type=int, default=512, help="tokens per resampled segment")
    g.add_argument("--chunk-size", type=int, default=512, help="tokens per forward pass")
    _add_common(parser, "distribution", _distribution)


def _add_split(evaluations: argparse._SubParsersAction) -> None:
    parser = evaluations.add_parser(
        "split",
        help="prefill/decode split vs co-location: KL and top-1 of the continuation",
        description="Each segment's prompt on a prefill engine, its KV pages handed over "
        "(densa's KV agents, in-process transport, conversion at landing) to a decode engine "
        "that scores the continuation; vs the reference and the decode formats co-located. "
        "See docs/disaggregation.md.",
    )
    g = parser.add_argument_group("the split")
    g.add_argument("--prefill", default=None, metavar="SPEC", help="prefill formats (--ref's)")
    g.add_argument("--decode", required=True, metavar="SPEC", help="decode formats")
    g.add_argument("--tokens", type=int, default=10240, help="tokens of text (whole segments)")
    g.add_argument("--segment-len", type=int, default=512, help="tokens per resampled segment")
    g.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help="prompt tokens per segment, whole pages (default: half a segment)",
    )
    g.add_argument(
        "--chunk-size", type=int, default=16, help="continuation tokens per forward pass"
    )
    test_help = "a further co-located format (the decode formats co-located always are)"
    _add_common(parser, "pd_split_distribution", _split, False, test_help)


def _add_choice(evaluations: argparse._SubParsersAction) -> None:
    parser = evaluations.add_parser(
        "choice",
        help="multiple-choice accuracy (ARC, HellaSwag, MMLU) by log-likelihood",
        description="Multiple-choice accuracy by log-likelihood per format, with paired "
        "bootstrap 95% CIs for the difference test - ref.",
    )
    g = parser.add_argument_group("evaluation")
    g.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    g.add_argument("--limit", type=int, default=250, help="questions per task (0 = all)")
    g.add_argument("--sample-seed", type=int, default=0, help="seed of the question sample")
    g.add_argument("--chunk-size", type=int, default=512, help="tokens per forward pass")
    _add_common(parser, "choice", _choice)


def _add_greedy(evaluations: argparse._SubParsersAction) -> None:
    parser = evaluations.add_parser(
        "greedy",
        help="are greedy generations token-identical to the reference?",
        description="Greedy chat generations per format: how many equal the reference's, and "
        "where the others first diverge.",
    )
    g = parser.add_argument_group("evaluation")
    g.add_argument("--num-prompts", type=int, default=20)
    g.add_argument("--max-tokens", type=int, default=128)
    _add_common(parser, "greedy", _greedy)


def _add_gsm8k(evaluations: argparse._SubParsersAction) -> None:
    parser = evaluations.add_parser(
        "gsm8k",
        help="GSM8K exact match, greedy and over sampled trials",
        description="Grade-school math (GSM8K test, few-shot chat) by exact match of the final "
        "number: greedy once and sampled under several seeds per format, paired deltas.",
    )
    g = parser.add_argument_group("evaluation")
    g.add_argument("--limit", type=int, default=60, help="problems scored")
    g.add_argument(
        "--num-seeds", type=int, default=5, help="sampled trials per problem (0: greedy only)"
    )
    g.add_argument("--max-tokens", type=int, default=192)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.95)
    _add_common(parser, "gsm8k", _gsm8k)


def _add_tools(evaluations: argparse._SubParsersAction) -> None:
    parser = evaluations.add_parser(
        "tools",
        help="tool-call validity and AST match on BFCL cases, constrained vs unconstrained",
        description="Berkeley function-calling cases (simple_python, multiple), asked with "
        "tool_choice auto (unconstrained) and required (grammar-constrained) per format.",
    )
    g = parser.add_argument_group("evaluation")
    g.add_argument("--limit-simple", type=int, default=70, help="simple_python cases")
    g.add_argument("--limit-multiple", type=int, default=30, help="multiple cases")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--sample-seed", type=int, default=0, help="seed of the case sample")
    _add_common(parser, "tools", _tools)


def _add_long_context(evaluations: argparse._SubParsersAction) -> None:
    parser = evaluations.add_parser(
        "long-context",
        help="pass-key retrieval and long-document QA at 4k..32k tokens, per KV format",
        description="Haystacks of SciQ science passages with pass keys and SciQ questions' "
        "passages hidden at spread depths, at each length; every format answers the same "
        "items greedily, paired, with 95%% CIs. Resumable: answers go to OUT/samples.jsonl.",
    )
    g = parser.add_argument_group("evaluation")
    g.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    g.add_argument("--haystacks", type=int, nargs="+", default=[6, 4, 3, 2],
                   help="documents per length (one count per --lengths entry)")  # fmt: skip
    g.add_argument("--passkeys", type=int, default=8, help="pass keys per document")
    g.add_argument("--questions", type=int, default=8, help="SciQ questions per document")
    g.add_argument("--max-tokens", type=int, default=24)
    g.add_argument("--doc-seed", type=int, default=0, help="documents, keys, option orders")
    _add_common(parser, "long_context", _long_context)
    # The engines are sized per run (an exact page count for the longest document); a fixed
    # KV byte budget would hold different token counts per format.
    parser.set_defaults(kv_cache_memory="auto")


# ---- handlers --------------------------------------------------------------------------------
# Each handler validates every option (formats, settings, data) before loading any engine, so a
# typo is one line on stderr and exit code 2, not a traceback minutes into a run.


def _formats(ns: argparse.Namespace) -> tuple[Format, list[Format]]:
    base = EngineArgs.from_cli(ns)
    return parse_format(ns.ref, base), [parse_format(spec, base) for spec in ns.test]


def _bootstrap(ns: argparse.Namespace) -> Any:
    from densa_bench.eval.stats import Bootstrap

    return Bootstrap(num_resamples=ns.resamples, seed=ns.bootstrap_seed)


def _distribution(ns: argparse.Namespace) -> int:
    from densa_bench.eval.distribution import DistributionSettings, run_distribution

    def prepare() -> Callable[[], Any]:
        settings = DistributionSettings(
            num_tokens=ns.tokens,
            segment_len=ns.segment_len,
            chunk_size=ns.chunk_size,
            bootstrap=_bootstrap(ns),
        )
        ref, tests = _formats(ns)
        return lambda: run_distribution(ref, tests, settings)

    return _run("distribution", prepare, ns.out)


def _split(ns: argparse.Namespace) -> int:
    from densa_bench.eval.distribution import DistributionSettings
    from densa_bench.eval.split import SplitFormats, SplitSettings, run_split

    def prepare() -> Callable[[], Any]:
        text = DistributionSettings(
            num_tokens=ns.tokens,
            segment_len=ns.segment_len,
            chunk_size=ns.chunk_size,
            bootstrap=_bootstrap(ns),
        )
        settings = SplitSettings(text, ns.prompt_len)
        settings.resolved_prompt_len(ns.page_size)
        base = EngineArgs.from_cli(ns)
        ref, tests = _formats(ns)
        prefill = parse_format(ns.ref if ns.prefill is None else ns.prefill, base)
        formats = SplitFormats(ref, prefill, parse_format(ns.decode, base), tests)
        return lambda: run_split(formats, settings)

    return _run("split", prepare, ns.out)


def _choice(ns: argparse.Namespace) -> int:
    from densa_bench.eval.choice import ChoiceSettings, run_choice

    def prepare() -> Callable[[], Any]:
        settings = ChoiceSettings(
            tasks=tuple(ns.tasks),
            limit=ns.limit or None,
            sample_seed=ns.sample_seed,
            chunk_size=ns.chunk_size,
            bootstrap=_bootstrap(ns),
        )
        ref, tests = _formats(ns)
        return lambda: run_choice(ref, tests, settings)

    return _run("choice", prepare, ns.out)


def _greedy(ns: argparse.Namespace) -> int:
    from densa_bench.eval.greedy import GreedySettings, run_greedy

    def prepare() -> Callable[[], Any]:
        settings = GreedySettings(num_prompts=ns.num_prompts, max_tokens=ns.max_tokens)
        ref, tests = _formats(ns)
        return lambda: run_greedy(ref, tests, settings)

    return _run("greedy", prepare, ns.out)


def _gsm8k(ns: argparse.Namespace) -> int:
    from densa_bench.eval.gsm8k import GSM8KSettings, gsm8k_path, run_gsm8k

    def prepare() -> Callable[[], Any]:
        settings = GSM8KSettings(
            limit=ns.limit,
            num_seeds=ns.num_seeds,
            max_tokens=ns.max_tokens,
            temperature=ns.temperature,
            top_p=ns.top_p,
            bootstrap=_bootstrap(ns),
        )
        gsm8k_path()
        ref, tests = _formats(ns)
        return lambda: run_gsm8k(ref, tests, settings)

    return _run("gsm8k", prepare, ns.out)


def _tools(ns: argparse.Namespace) -> int:
    from densa_bench.eval.bfcl import data_dir
    from densa_bench.eval.tool_calls import ToolEvalSettings, run_tool_eval

    def prepare() -> Callable[[], Any]:
        settings = ToolEvalSettings(
            limit_simple=ns.limit_simple,
            limit_multiple=ns.limit_multiple,
            max_tokens=ns.max_tokens,
            sample_seed=ns.sample_seed,
            bootstrap=_bootstrap(ns),
        )
        data_dir()
        ref, tests = _formats(ns)
        return lambda: run_tool_eval(ref, tests, settings)

    return _run("tools", prepare, ns.out)


def _long_context(ns: argparse.Namespace) -> int:
    from densa_bench.eval.long_context import LongContextSettings, run_long_context
    from densa_bench.eval.long_context_data import load_sciq

    def prepare() -> Callable[[], Any]:
        settings = LongContextSettings(
            lengths=tuple(ns.lengths),
            haystacks=tuple(ns.haystacks),
            passkeys=ns.passkeys,
            questions=ns.questions,
            max_tokens=ns.max_tokens,
            seed=ns.doc_seed,
            bootstrap=_bootstrap(ns),
        )
        load_sciq()
        ref, tests = _formats(ns)
        return lambda: run_long_context(ref, tests, settings, ns.out)

    return _run("long-context", prepare, ns.out)


def _run(name: str, prepare: Callable[[], Callable[[], Any]], out: Path) -> int:
    """Validate (a bad option or missing data: a message and exit code 2), run, write."""
    try:
        run = prepare()
        data_root()
    except (ValueError, FileNotFoundError) as exc:
        print(f"densa eval {name}: {exc}", file=sys.stderr)
        return 2
    report = run()
    paths = report.write(out)
    for table in report.tables[1:]:  # the first lists the formats, which the user just gave
        print(table.to_markdown() + "\n")
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0
