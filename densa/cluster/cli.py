"""`densa cluster up --config cluster.yaml` and `densa cluster check --config cluster.yaml`."""

from __future__ import annotations

import argparse
import signal
import threading
from types import FrameType

from densa.cluster.config import ClusterConfig, load_config
from densa.cluster.processes import default_log_dir


def add_cluster_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "cluster", help="run the router and worker pools on Ray (docs/cluster.md)",
        description="The router and densa worker pools as Ray actors: placement groups, "
        "restarts, and the router told every membership change (docs/cluster.md).",
    )  # fmt: skip
    actions = parser.add_subparsers(title="actions", metavar="ACTION", dest="action")
    up = actions.add_parser("up", help="start the cluster and keep it running until Ctrl-C")
    up.add_argument("--config", required=True, help="cluster.yaml (docs/cluster.md)")
    up.add_argument(
        "--log-dir",
        default=str(default_log_dir()),
        help="each process's log, on the node it runs on, and a new cluster secret: a directory "
        "of this user's alone, made 0700 (default: %(default)s)",
    )
    up.set_defaults(handler=run_up)
    check = actions.add_parser("check", help="validate cluster.yaml and print the plan")
    check.add_argument("--config", required=True)
    check.set_defaults(handler=run_check)
    parser.set_defaults(handler=lambda ns: (parser.print_help(), 2)[1])


def plan(config: ClusterConfig) -> list[str]:
    where = config.ray_address or f"a local Ray instance ({config.ray_num_cpus or 'sized to fit'})"
    secret = config.secret_file or "$DENSA_CLUSTER_SECRET, else a new one in --log-dir"
    lines = [f"Ray: {where}; placement {config.placement}",
             f"cluster secret: {secret} (to every member in its environment)",
             f"router: {config.router.host}:{config.router.port}, {config.router.num_cpus:g} CPU, "
             f"args {list(config.router.args)}"]  # fmt: skip
    for pool in config.pools:
        args = [*config.serve_args, *pool.args]
        lines.append(f"pool {pool.name}: {pool.replicas} x densa serve --role {pool.role}, "
                     f"{pool.num_cpus:g} CPU each, args {args}")  # fmt: skip
    return lines


def run_check(ns: argparse.Namespace) -> int:
    for line in plan(load_config(ns.config)):
        print(line)
    return 0


def _say(line: str) -> None:
    print(f"densa cluster: {line}", flush=True)


def run_up(ns: argparse.Namespace) -> int:
    config = load_config(ns.config)  # a bad file: one line, before Ray starts
    try:
        from densa.cluster.supervisor import Cluster
    except ImportError as exc:
        raise ValueError(f"densa cluster needs Ray ({exc}): pip install 'densa[cluster]'") from None
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    cluster = Cluster(config, ns.log_dir, say=_say)
    try:
        url = cluster.up()  # Ctrl-C meanwhile: KeyboardInterrupt, and down() below
        # After up(): ray.init installs handlers of its own that would kill this process.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        print(f"densa cluster: serving the OpenAI API at {url}/v1 (Ctrl-C stops)", flush=True)
        cluster.follow(stop)
    finally:
        cluster.down()
    return 0
