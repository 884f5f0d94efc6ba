"""The engine core's own process: `python -m densa.engine.core_process --engine-args-fd N ...`.

Started by the front (engine/launch.py ProcessLauncher), which hands it its options as JSON
through an inherited pipe (`--engine-args-fd`): they may hold secrets, and a command line is
readable by every user of the host. By hand on another host, with tcp:// addresses, give them
as `--engine-args JSON` (or `--engine-args-fd 0` with the JSON on standard input). It loads
the model, says Hello, and serves until Shutdown. If loading fails it sends EngineFailed with a
one-line reason (the front shows it and exits) and exits 2.

Signals: SIGINT is ignored (Ctrl-C reaches the whole process group; the front drains first, then
sends Shutdown); SIGTERM ends the process at once. If the front dies, the heartbeat thread notices
its parent is gone and the process exits, so no engine is ever orphaned.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import zmq

from densa.ipc import codec, transport
from densa.ipc.messages import EngineFailed
from densa.utils.logging import configure_logging, get_logger

if TYPE_CHECKING:
    from densa.engine.llm_engine import LLMEngine

logger = get_logger("densa.engine.core_process")


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    configure_logging(ns.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    addresses = transport.Addresses(ns.requests, ns.outputs)
    context = zmq.Context()
    try:
        engine_args = json.loads(_engine_args_text(ns))
        engine = _load(engine_args, addresses, context)
        if engine is None:
            return 2
        from densa.engine.core import CoreOptions, EngineCore

        options = CoreOptions(ns.debug_controls, ns.parent_pid)
        EngineCore(engine, addresses, context, options).run()
        return 0
    finally:
        context.term()


def _load(
    engine_args: dict[str, Any], addresses: transport.Addresses, context: zmq.Context
) -> LLMEngine | None:
    """The engine, or None after telling the front why it could not be built."""
    from densa.engine.llm_engine import LLMEngine
    from densa.setup.args import EngineArgs

    try:
        return LLMEngine.from_args(EngineArgs(**engine_args))
    except Exception as exc:
        reason = (str(exc) or type(exc).__name__).splitlines()[0]
        # One line for whoever reads the log; the traceback only at --log-level debug.
        logger.error("the engine failed to start: %s", reason)
        logger.debug("the engine failed to start", exc_info=True)
        socket = transport.configure(context.socket(zmq.PUSH))
        socket.setsockopt(zmq.LINGER, 2000)  # make sure the reason gets out before we exit
        socket.connect(addresses.outputs)
        socket.send(codec.encode(EngineFailed(reason)))
        socket.close()
        return None


def _engine_args_text(ns: argparse.Namespace) -> str:
    if ns.engine_args is not None:
        return str(ns.engine_args)
    with os.fdopen(ns.engine_args_fd, "rb") as pipe:  # read to the end: the front closes it
        return pipe.read().decode("utf-8")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="densa-engine-core", description=__doc__)
    options = parser.add_mutually_exclusive_group(required=True)
    options.add_argument("--engine-args", help="EngineArgs fields as JSON (seen by `ps`)")
    options.add_argument(
        "--engine-args-fd", type=int, metavar="FD", help="read the JSON from this descriptor"
    )
    parser.add_argument("--requests", required=True, help="address the front sends requests to")
    parser.add_argument("--outputs", required=True, help="address the front reads outputs from")
    parser.add_argument("--parent-pid", type=int, default=os.getppid(), help="exit if it exits")
    parser.add_argument("--debug-controls", action="store_true", help="honour SetStepDelay")
    parser.add_argument("--log-level", default="info")
    return parser


if __name__ == "__main__":
    sys.exit(main())
