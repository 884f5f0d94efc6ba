"""`densa router`: its flags, and the process that serves the router until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator

import uvicorn

from densa.auth.secret import SECRET_ENV, load_secret
from densa.router.config import RouterConfig
from densa.router.membership import ADMIN_TOKEN_ENV
from densa.router.policy import POLICIES, SIGNALS, Weights
from densa.router.workers import HealthOptions
from densa.utils.logging import get_logger

logger = get_logger(__name__)
_DEFAULTS = Weights()
_SIGNAL_HELP = {
    "affinity": "a live session's worker (x-session-affinity, sticky for --session-ttl)",
    "ring": "a new session's home on the consistent-hash ring",
    "prefix": "share of the prompt's blocks the worker probably caches (same tenant only)",
    "kv": "share of the worker's KV pages free after this request's prompt and expected output",
    "queue": "fewer requests running or waiting on the worker than on the busiest one",
    "length": "less expected decode work (open requests' expected output) than the busiest",
}


def add_router_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "router", help="route OpenAI requests over several densa workers (docs/routing.md)",
        description="A torch-free router in front of densa workers: same OpenAI endpoints, each "
        "request placed by a weighted score of session affinity, prefix overlap, free KV, queue "
        "depth and expected output length (docs/routing.md).",
        epilog=f"With ${ADMIN_TOKEN_ENV} set, GET and PUT /densa/workers (Authorization: Bearer "
        "<it>) list and replace the worker set while the router serves (densa cluster uses it).",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    _add_worker_options(parser)
    _add_policy_options(parser)
    _add_health_options(parser)
    parser.set_defaults(handler=run_router_command)


def _add_worker_options(parser: argparse.ArgumentParser) -> None:
    pools = parser.add_argument_group("workers (base URLs, e.g. http://10.0.0.5:8000)")
    pools.add_argument("--worker", action="append", default=[], metavar="URL",
                       help="a co-located worker (prefill and decode); repeat")  # fmt: skip
    pools.add_argument("--prefill", action="append", default=[], metavar="URL",
                       help="a prefill-pool worker; repeat (needs --decode)")  # fmt: skip
    pools.add_argument("--decode", action="append", default=[], metavar="URL",
                       help="a decode-pool worker; repeat (needs --prefill)")  # fmt: skip
    pools.add_argument(
        "--cluster-secret-file", metavar="FILE",
        help=f"the cluster secret (else ${SECRET_ENV}); needed with --prefill/--decode: the "
        "router signs each placement with it, and decode workers act on no other",
    )  # fmt: skip
    pools.add_argument(
        "--shared-kv-tier", action="store_true",
        help="treat every worker as reading one shared KV tier (--kv-tier shared:redis://...): "
        "a prefix routed to any worker counts, below a device hit, as fetchable by all. Not "
        "needed with densa workers: each reports its store, and workers of the same store "
        "(same URL, model and cluster secret) are credited with each other's prefixes",
    )  # fmt: skip
    pools.add_argument(
        "--debug-headers", action="store_true",
        help="add x-densa-worker, x-densa-prefill and x-densa-router-ms to answers (off: they "
        "tell any client the workers' addresses and time the router's own work)",
    )  # fmt: skip


def _add_policy_options(parser: argparse.ArgumentParser) -> None:
    policy = parser.add_argument_group("policy")
    policy.add_argument("--policy", default="densa", choices=list(POLICIES),
                        help="densa (the weighted score) or a single-signal baseline")  # fmt: skip
    for name in SIGNALS:
        policy.add_argument(
            f"--{name}-weight", type=float, default=getattr(_DEFAULTS, name),
            help=f"{_SIGNAL_HELP[name]} (default {getattr(_DEFAULTS, name):g})",
        )  # fmt: skip
    policy.add_argument(
        "--session-ttl", type=float, default=600.0,
        help="seconds a session stays stuck to its worker after its last request",
    )  # fmt: skip
    policy.add_argument("--expected-tokens", type=int, default=256,
                        help="expected output length before any request has finished")  # fmt: skip


def _add_health_options(parser: argparse.ArgumentParser) -> None:
    health = parser.add_argument_group("health")
    health.add_argument("--poll-interval", type=float, default=0.5,
                        help="seconds between load polls of each worker")  # fmt: skip
    health.add_argument("--max-backoff", type=float, default=30.0,
                        help="longest wait between probes of an ejected worker")  # fmt: skip
    health.add_argument(
        "--max-attempts", type=int, default=3,
        help="workers one request may be tried on before any byte is sent",
    )  # fmt: skip
    health.add_argument(
        "--upstream-timeout", type=float, default=600.0,
        help="seconds without a byte from a worker before the attempt fails",
    )  # fmt: skip


def config_from(ns: argparse.Namespace) -> RouterConfig:
    weights = Weights(**{s: getattr(ns, f"{s}_weight") for s in SIGNALS})
    health = HealthOptions(poll_interval_s=ns.poll_interval, max_backoff_s=ns.max_backoff)
    return RouterConfig(
        workers=tuple(ns.worker), prefill=tuple(ns.prefill), decode=tuple(ns.decode),
        policy=ns.policy, weights=weights, session_ttl_s=ns.session_ttl, health=health,
        max_attempts=ns.max_attempts, upstream_timeout_s=ns.upstream_timeout,
        default_expected_tokens=ns.expected_tokens,
        admin_token=os.environ.get(ADMIN_TOKEN_ENV) or None,
        secret=load_secret(ns.cluster_secret_file), debug_headers=ns.debug_headers,
        shared_kv_tier=ns.shared_kv_tier,
    )  # fmt: skip


def run_router_command(ns: argparse.Namespace) -> int:
    from densa.openai.http_protocol import DEFAULT_HEADER_TIMEOUT, with_header_timeout
    from densa.router.app import build_router_app
    from densa.utils.net import bind_listener

    config = config_from(ns)  # a bad flag: one line, before binding anything
    sock = bind_listener(ns.host, ns.port)
    try:
        app = build_router_app(config)
        level = (ns.log_level or "info").lower()
        http = with_header_timeout(DEFAULT_HEADER_TIMEOUT)
        server = _RouterServer(uvicorn.Config(app, log_level=level, http=http))
        n = len(config.roles())
        logger.info("router on http://%s:%d over %d workers (policy %s)", ns.host, ns.port, n,
                    config.policy)  # fmt: skip
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        sock.close()
    return 0


class _RouterServer(uvicorn.Server):
    """uvicorn that exits normally after its graceful shutdown on SIGINT/SIGTERM (uvicorn itself
    re-raises the signal at exit, which a supervisor reads as a crash)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
