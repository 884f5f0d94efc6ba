"""The `densa` command: serve, generate, and the measurement tools (bench, capacity, quantize)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from densa.bench import add_bench_parser
from densa.utils.logging import configure_logging

Command = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    configure_logging(ns.log_level)
    if not hasattr(ns, "handler"):
        parser.print_help()
        return 2
    try:
        return int(ns.handler(ns))
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="densa",
        description="An LLM inference server that packs more work into the same memory, safely.",
    )
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING, ERROR")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_serve(commands)
    _add_generate(commands)
    add_bench_parser(commands)
    return parser


def _add_serve(commands: argparse._SubParsersAction) -> None:
    from densa.engine.args import EngineArgs

    parser = commands.add_parser(
        "serve", help="serve the OpenAI-compatible HTTP API", description="Serve a model over HTTP."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger requests get 413"
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds running requests may finish after SIGTERM before they are aborted",
    )
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_serve)


def _serve(ns: argparse.Namespace) -> int:
    from densa.engine.args import EngineArgs
    from densa.serve.api_server import run_server

    run_server(
        EngineArgs.from_cli(ns),
        host=ns.host,
        port=ns.port,
        max_body_bytes=ns.max_body_bytes,
        drain_timeout=ns.drain_timeout,
    )
    return 0


def _add_generate(commands: argparse._SubParsersAction) -> None:
    from densa.engine.args import EngineArgs

    parser = commands.add_parser(
        "generate", help="generate text for prompts (offline)", description="Generate offline."
    )
    parser.add_argument("prompts", nargs="*", help="prompts (default: read lines from stdin)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_generate)


def _generate(ns: argparse.Namespace) -> int:
    from densa.engine.args import EngineArgs
    from densa.engine.llm import LLM
    from densa.sampling_params import SamplingParams

    prompts = ns.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("densa generate: no prompts given", file=sys.stderr)
        return 2
    params = SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k
    )
    args = EngineArgs.from_cli(ns)
    llm = LLM(**vars(args))
    if ns.chat:
        inputs = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        results = llm.generate(inputs, params, use_tqdm=len(prompts) > 1)
    else:
        results = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for prompt, result in zip(prompts, results, strict=True):
        print(
            f"=== {prompt}\n{result.text}\n[{result.finish_reason}, {len(result.token_ids)} tokens]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
