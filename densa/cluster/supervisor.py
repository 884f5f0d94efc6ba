"""`densa cluster up`: the router and the worker pools as Ray actors, kept in step.

    up()        Ray (local or joined) -> one placement group (a bundle for the router and one per
                worker) -> the worker actors -> their URLs -> the router actor, started with them
    follow()    every FOLLOW_INTERVAL_S: each actor's status; if the worker URLs changed (an
                actor Ray restarted got a new port) or the router restarted (it came back with
                its start-up flags), PUT the current set to the router
    down()      stop every process (drain), kill the actors, free the placement group

The supervisor holds no request state: if it dies, the actors and the router keep serving, only
membership stops following changes until it is started again.

The cluster secret (densa/auth/secret.py) is config.secret_file's, else $DENSA_CLUSTER_SECRET's,
else a new one written 0600 to <log dir>/cluster-secret (for members started by hand; the log
dir must be this user's alone: utils/private_files.py). Every process gets it in its
environment, through its actor's spec: never on a command line. Ray carries that spec to the
actor's node (and keeps it to restart the actor), so whoever can use the Ray cluster can read
the secret: Ray's members are inside the boundary.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from densa.auth.secret import ClusterSecret, load_secret
from densa.cluster.actors import RemoteProcessActor
from densa.cluster.config import ClusterConfig, PoolConfig
from densa.cluster.processes import ProcessSpec, ProcessStatus
from densa.router.membership import ADMIN_TOKEN_ENV
from densa.utils.private_files import private_dir

FOLLOW_INTERVAL_S = 0.5
OBJECT_STORE_BYTES = 128 * 1024 * 1024  # a local instance's (Ray's minimum is 75 MiB)
STATUS_TIMEOUT_S = 2.0
ROUTER_FLAG = {"both": "--worker", "prefill": "--prefill", "decode": "--decode"}
MEMBERSHIP_KEY = {"both": "workers", "prefill": "prefill", "decode": "decode"}


@dataclass
class Member:
    """One actor and what the supervisor last heard from it."""

    name: str
    role: str  # "router" or a pool role
    actor: Any
    status: ProcessStatus | None = None


class Cluster:
    def __init__(self, config: ClusterConfig, log_dir: str,
                 say: Callable[[str], None] = print) -> None:  # fmt: skip
        self.config = config
        self.log_dir = str(private_dir(log_dir))  # another user's directory: refused, before Ray
        self.say = say
        self.token = secrets.token_urlsafe(24)
        self.secret_path: Path | None = None  # where a secret made here was written
        self.secret = self._cluster_secret()  # a bad secret file: one line, before Ray starts
        self.workers: list[Member] = []
        self.router: Member | None = None
        self._pushed: dict[str, list[str]] | None = None
        self._router_generation = 0
        self._pg: Any = None
        self._started_ray = False

    def _cluster_secret(self) -> ClusterSecret:
        secret = load_secret(self.config.secret_file)
        if secret is not None:
            return secret
        secret = ClusterSecret.generate()
        # The log dir is this user's alone (checked above), so the old secret unlinked below is
        # ours, and the new one is created where nobody can plant a file or a symlink first.
        self.secret_path = Path(self.log_dir) / "cluster-secret"
        self.secret_path.unlink(missing_ok=True)  # the last run's: members need this run's
        secret.write(self.secret_path)
        self.say(f"new cluster secret in {self.secret_path} (mode 0600; give it to members "
                 f"started by hand with --cluster-secret-file)")  # fmt: skip
        return secret

    # ---- up ----------------------------------------------------------------------------------
    def up(self, timeout_s: float = 300.0) -> str:
        """Start everything; returns the router's URL once it answers /health."""
        self._init_ray()
        self._pg = placement_group(self._bundles(), strategy=self.config.placement)
        if not self._pg.wait(timeout_seconds=int(timeout_s)):
            raise RuntimeError(f"Ray could not place {len(self._bundles())} bundles "
                               f"({self.config.placement}) within {timeout_s:g} s: "
                               f"not enough CPUs in the cluster?")  # fmt: skip
        self.say(f"placement group ready: {len(self._bundles())} bundles, {self.config.placement}")
        self.workers = self._start_workers()
        self._first_statuses(self.workers, timeout_s)
        for member in self.workers:
            assert member.status is not None
            self.say(f"worker {member.name} ({member.role}) at {member.status.url}")
        self.router = self._start_router()
        self._first_statuses([self.router], timeout_s)
        assert self.router.status is not None
        self._router_generation = self.router.status.generation
        self._pushed = self.membership()
        self._wait_router_healthy(timeout_s)
        self.say(f"router at {self.router.status.url} over {len(self.workers)} workers")
        return self.router.status.url

    def _init_ray(self) -> None:
        if ray.is_initialized():
            return
        if self.config.ray_address is None:
            cpus = self.config.ray_num_cpus or sum(b["CPU"] for b in self._bundles())
            # No data goes through Ray's object store here (only actor calls): keep it small
            # rather than Ray's default 30% of RAM in /dev/shm.
            ray.init(num_cpus=math.ceil(cpus), include_dashboard=False, log_to_driver=False,
                     configure_logging=False, object_store_memory=OBJECT_STORE_BYTES)  # fmt: skip
            self.say(f"started a local Ray instance ({math.ceil(cpus)} CPUs)")
        else:
            ray.init(address=self.config.ray_address, log_to_driver=False)
            self.say(f"joined the Ray cluster at {self.config.ray_address}")
        self._started_ray = True

    def _bundles(self) -> list[dict[str, float]]:
        """Bundle 0 is the router's; then one per worker, pool by pool."""
        workers = [{"CPU": p.num_cpus} for p in self.config.pools for _ in range(p.replicas)]
        return [{"CPU": self.config.router.num_cpus}, *workers]

    def _actor(self, spec: ProcessSpec, num_cpus: float, bundle: int, public: bool) -> Any:
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self._pg, placement_group_bundle_index=bundle
        )
        return RemoteProcessActor.options(
            num_cpus=num_cpus, max_restarts=-1, max_task_retries=0, max_concurrency=4,
            scheduling_strategy=strategy, name=f"densa-{spec.name}-{self.token[:6]}",
        ).remote(spec, self.config.restart, public)  # fmt: skip

    def _start_workers(self) -> list[Member]:
        members, bundle = [], 1
        public = self.config.ray_address is not None
        for pool in self.config.pools:
            for i in range(pool.replicas):
                spec = self._worker_spec(pool, f"{pool.name}-{i}")
                actor = self._actor(spec, pool.num_cpus, bundle, public)
                members.append(Member(spec.name, pool.role, actor))
                bundle += 1
        return members

    def _worker_spec(self, pool: PoolConfig, name: str) -> ProcessSpec:
        kv = ["--kv-listen", "tcp://{host}:0"] if pool.role == "prefill" else []
        argv = ("serve", "--host", "{host}", "--port", "{port}", "--role", pool.role, *kv,
                *self.config.serve_args, *pool.args)  # fmt: skip
        threads = str(max(1, math.floor(pool.num_cpus)))
        env = (("OMP_NUM_THREADS", threads), ("NUMBA_NUM_THREADS", threads))
        return ProcessSpec(name, argv, host="127.0.0.1", env=env, log_dir=self.log_dir,
                           secret=self.secret)  # fmt: skip

    def _start_router(self) -> Member:
        spec = self.config.router
        flags = [a for m in self.workers if m.status
                 for a in (ROUTER_FLAG[m.role], m.status.url)]  # fmt: skip
        argv = ("router", "--host", "{host}", "--port", "{port}", *flags, *spec.args)
        env = ((ADMIN_TOKEN_ENV, self.token),)
        process = ProcessSpec("router", argv, spec.host, spec.port, env, self.log_dir, self.secret)
        return Member("router", "router", self._actor(process, spec.num_cpus, 0, False))

    def _wait_router_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                code, _ = self.call_router("GET", "/health")
                if code == 200:
                    return
            except Exception:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the router was not healthy within {timeout_s:g} s "
                           f"(logs: {self.log_dir})")  # fmt: skip

    # ---- following ---------------------------------------------------------------------------
    def _first_statuses(self, members: list[Member], timeout_s: float) -> None:
        """Wait for new actors' first status: Ray may take seconds to start their processes."""
        self.refresh(members, timeout_s)
        missing = [m.name for m in members if m.status is None]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} did not start within {timeout_s:g} s "
                               f"(logs: {self.log_dir})")  # fmt: skip

    def refresh(self, members: list[Member] | None = None,
                timeout_s: float = STATUS_TIMEOUT_S) -> None:  # fmt: skip
        """Ask the actors (default: all) for their status; one restarting (or unreachable) keeps
        its last one."""
        if members is None:
            members = [*self.workers, *([self.router] if self.router else [])]
        refs = {m.actor.status.remote(): m for m in members}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            # An actor that died raises: Ray is restarting it, and its next status tells.
            with contextlib.suppress(ray.exceptions.RayError):
                refs[ref].status = ray.get(ref)

    def membership(self) -> dict[str, list[str]]:
        pools: dict[str, list[str]] = {"workers": [], "prefill": [], "decode": []}
        for member in self.workers:
            if member.status is not None:
                pools[MEMBERSHIP_KEY[member.role]].append(member.status.url)
        return pools

    def follow_once(self) -> bool:
        """One round; returns whether the router was told a new worker set."""
        self.refresh()
        assert self.router is not None and self.router.status is not None
        restarted = self.router.status.generation != self._router_generation
        current = self.membership()
        if current == self._pushed and not restarted:
            return False
        try:
            code, body = self.call_router("PUT", "/densa/workers", current,
                                          {"authorization": f"Bearer {self.token}"})  # fmt: skip
        except Exception as exc:
            self.say(f"membership not pushed yet ({type(exc).__name__}); retrying")
            return False
        if code != 200:
            self.say(f"the router refused the membership ({code}): {body}")
            return False
        self._pushed, self._router_generation = current, self.router.status.generation
        self.say(f"router told: joined {body.get('joined')}, left {body.get('left')}")
        return True

    def follow(self, stop: threading.Event) -> None:
        while not stop.wait(FOLLOW_INTERVAL_S):
            self.follow_once()

    def call_router(self, method: str, path: str, body: Any = None,
                    headers: dict[str, str] | None = None) -> tuple[int, Any]:  # fmt: skip
        assert self.router is not None
        code, answer = ray.get(self.router.actor.call.remote(method, path, body, headers),
                               timeout=15)  # fmt: skip
        return int(code), answer

    # ---- down --------------------------------------------------------------------------------
    def down(self) -> None:
        """Drain and stop every process, then the actors, the placement group and Ray (if ours)."""
        members = [*([self.router] if self.router else []), *self.workers]
        stops = [m.actor.stop.remote() for m in members]
        ray.wait(stops, num_returns=len(stops), timeout=60)
        # Best effort from here: an actor Ray already lost cannot be killed twice, and each
        # server dies with its actor anyway (PR_SET_PDEATHSIG).
        for member in members:
            with contextlib.suppress(Exception):
                ray.kill(member.actor, no_restart=True)
        if self._pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
        if self._started_ray:
            ray.shutdown()
        self.say("cluster down")
