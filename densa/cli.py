"""The `densa` command: serve, generate; tools (quantize, capacity, calibrate-kv); bench; eval."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from densa.cluster.cli import add_cluster_parser
from densa.offline import add_tool_parsers
from densa.router.cli import add_router_parser
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
    except Exception as exc:
        # One clear line for an operator; the traceback is for whoever debugs densa itself.
        if ns.debug:
            raise
        print(f"densa {ns.command}: error: {_describe(exc)}", file=sys.stderr)
        print(f"(run `densa --debug {ns.command} ...` for the traceback)", file=sys.stderr)
        return 2 if _is_expected(exc) else 1


def _describe(exc: BaseException) -> str:
    """The message of an expected error (what went wrong and what to do) as is; the type too
    for anything else, since its message alone may not say what kind of failure it was."""
    message = (str(exc) or type(exc).__name__).splitlines()[0]
    return message if _is_expected(exc) else f"{type(exc).__name__}: {message}"


def _is_expected(exc: BaseException) -> bool:
    """Errors of the user's setup (options, files, ports, a model that cannot load), as opposed
    to bugs in densa."""
    from densa.engine.client import EngineStartError
    from densa.model.arch import ModelLoadError

    return isinstance(exc, ModelLoadError | ValueError | OSError | EngineStartError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="densa",
        description="An LLM inference server that packs more work into the same memory, safely.",
    )
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING, ERROR")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error, not just one line"
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command")
    _add_serve(commands)
    add_router_parser(commands)
    add_cluster_parser(commands)
    _add_generate(commands)
    add_tool_parsers(commands)  # densa quantize, densa capacity, densa calibrate-kv
    _add_measurement(commands)
    return parser


def _add_measurement(commands: argparse._SubParsersAction) -> None:
    """`densa bench` and `densa eval`, from the measurement package beside densa (densa_bench):
    the one place densa imports it, here when the parser is built, never at module level."""
    from densa_bench.cli import add_bench_parser
    from densa_bench.eval.cli import add_eval_parser

    add_bench_parser(commands)
    add_eval_parser(commands)


def _add_serve(commands: argparse._SubParsersAction) -> None:
    from densa.setup.args import EngineArgs

    parser = commands.add_parser(
        "serve", help="serve the OpenAI-compatible HTTP API", description="Serve a model over HTTP."
    )
    _add_http_options(parser)
    _add_engine_process_options(parser)
    parser.add_argument(
        "--tool-call-format",
        default="auto",
        help="how the model writes tool calls: auto (default: from the chat template), hermes, "
        "llama3_json, kimi_k2, deepseek_v3, deepseek_v31, glm, qwen3_coder, mistral, "
        "mistral_json (docs/serving.md, 'Tool calls')",
    )
    _add_api_options(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_serve)


def _add_http_options(parser: argparse.ArgumentParser) -> None:
    """The HTTP front: where it listens, what it accepts, how long clients may take."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=8000)
    parser.add_argument(
        "--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger requests get 413"
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds running requests may finish after SIGTERM before they are aborted",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds one request may take before it is aborted with 504 (default: no limit)",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require 'Authorization: Bearer KEY' on /v1/* (repeat for several keys)",
    )
    parser.add_argument("--api-key-file", default=None, help="more API keys, one per line")
    parser.add_argument(
        "--prefill-peer", action="append", default=[], metavar="URL",
        help="decode role: a prefill worker (scheme://host:port) requests may name in "
        "x-densa-prefill without the router's signed placement (repeatable; docs/security.md)",
    )  # fmt: skip
    parser.add_argument(
        "--header-timeout", type=_seconds, default=10.0,
        help="seconds a client may take to send its request headers (then 408 and close)",
    )  # fmt: skip
    parser.add_argument(
        "--body-timeout", type=_seconds, default=30.0,
        help="seconds a client may take to send its request body (then 408)",
    )  # fmt: skip


def _add_engine_process_options(parser: argparse.ArgumentParser) -> None:
    """Where the engine core runs, and when the front gives up on it."""
    g = parser.add_argument_group("engine process")
    g.add_argument(
        "--engine-placement", choices=["process", "thread"], default="process",
        help="the engine core in its own process (default), or on a thread of the HTTP front's",
    )  # fmt: skip
    g.add_argument(
        "--engine-step-timeout", type=_seconds, default=120.0,
        help="an engine step running longer means the engine is stuck: it is killed, restarted",
    )  # fmt: skip
    g.add_argument(
        "--engine-restarts", type=int, default=3,
        help="engines that die within 10 minutes of starting, in a row, before the server gives "
        "up and exits 1 (for a supervisor to restart it)",
    )  # fmt: skip


def _add_api_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("API compatibility (docs/serving.md)")
    g.add_argument(
        "--strict-api", action="store_true",
        help="refuse unknown request fields with a 400, as OpenAI does (default: ignore them, "
        "with a warning logged once per field and the x-densa-ignored-fields response header)",
    )  # fmt: skip
    g.add_argument(
        "--reasoning-parser", default=None, metavar="NAME",
        help="split a reasoning model's thinking into reasoning_content: deepseek_r1, qwen3, "
        "kimi_k2 or glm45 (docs/serving.md)",
    )  # fmt: skip
    g.add_argument(
        "--chat-template", default=None, metavar="FILE",
        help="a Jinja chat template that replaces the model's",
    )  # fmt: skip
    g.add_argument(
        "--accept-any-model-name", action="store_true",
        help="serve whatever 'model' a request names (responses echo it) instead of a 404 for "
        "names other than --served-model-name's",
    )  # fmt: skip


def _port(text: str) -> int:
    port = int(text) if text.isdigit() else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0-65535)")
    return port


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _serve(ns: argparse.Namespace) -> int:
    from densa.setup.args import EngineArgs
    from densa.utils.net import bind_listener

    # Checked before importing the server (torch, transformers: seconds) and loading the model.
    args = EngineArgs.from_cli(ns)
    args.check()
    bind_listener(ns.host, ns.port).close()
    from densa.openai.tools.formats import AUTO, tool_format
    from densa.serve import run_server

    if ns.tool_call_format != AUTO:
        tool_format(ns.tool_call_format)  # an unknown format: one line, before the model loads
    if ns.reasoning_parser is not None:
        from densa.openai.reasoning import reasoning_format

        reasoning_format(ns.reasoning_parser)

    run_server(
        args,
        host=ns.host,
        port=ns.port,
        max_body_bytes=ns.max_body_bytes,
        drain_timeout=ns.drain_timeout,
        request_timeout=ns.request_timeout,
        api_keys=tuple(ns.api_key),
        api_key_file=ns.api_key_file,
        header_timeout=ns.header_timeout,
        body_timeout=ns.body_timeout,
        engine_placement=ns.engine_placement,
        engine_step_timeout=ns.engine_step_timeout,
        engine_restarts=ns.engine_restarts,
        tool_call_format=ns.tool_call_format,
        prefill_peers=tuple(ns.prefill_peer),
        strict_api=ns.strict_api,
        served_model_names=tuple(ns.served_model_name or ()),
        accept_any_model_name=ns.accept_any_model_name,
        reasoning_parser=ns.reasoning_parser,
        chat_template=ns.chat_template,
    )
    return 0


def _add_generate(commands: argparse._SubParsersAction) -> None:
    from densa.setup.args import EngineArgs

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
    from densa.engine.llm import LLM
    from densa.sampling_params import SamplingParams
    from densa.setup.args import EngineArgs

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
