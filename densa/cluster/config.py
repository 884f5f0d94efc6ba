"""cluster.yaml -> ClusterConfig, validated once (every error names the key and what to do).

ray:                      # where the cluster runs
  address: null           #   null: start a local Ray instance; "auto" or "HOST:6379": join one
  num_cpus: 4             #   CPUs of a local instance (ignored when joining)
placement: PACK           # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD over all bundles
secret_file: null         # the cluster secret (a 0600 file on the supervisor's machine); null:
                          #   $DENSA_CLUSTER_SECRET if set, else `up` makes one in --log-dir
serve_args: [--max-num-seqs, "8"]   # `densa serve` flags every worker gets
router:
  host: 127.0.0.1         # 0.0.0.0 to take clients from other machines
  port: 8080
  num_cpus: 0.5
  args: [--policy, densa] # `densa router` flags (not --worker/--prefill/--decode: the pools)
pools:
  - name: chat            # one Ray actor per replica, each in its own placement bundle
    role: both            # both | prefill | decode (prefill and decode come together)
    replicas: 2
    num_cpus: 1
    args: [--threads, "1"]
restart:                  # a worker process that exits is started again after a backoff
  backoff_s: 1.0
  max_backoff_s: 30.0
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROLES = ("both", "prefill", "decode")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# Flags the cluster sets itself: each worker's address, the router's pools, and the secret
# (every member gets the cluster's own, through its environment).
_OWN_SERVE_FLAGS = ("--host", "--port", "--role", "--kv-listen", "--cluster-secret-file")
_OWN_ROUTER_FLAGS = ("--host", "--port", "--worker", "--prefill", "--decode",
                     "--cluster-secret-file")  # fmt: skip


class ClusterConfigError(ValueError):
    """cluster.yaml says something densa cannot run (the message names the key)."""


@dataclass(frozen=True)
class PoolConfig:
    name: str
    role: str = "both"
    replicas: int = 1
    num_cpus: float = 1.0
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class RouterSpec:
    host: str = "127.0.0.1"
    port: int = 8080
    num_cpus: float = 0.5
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def delay(self, num_restarts: int) -> float:
        """Wait before restart number `num_restarts` (1, 2, ...): base, 2 base, 4 base, ..."""
        return min(self.backoff_s * 2 ** max(num_restarts - 1, 0), self.max_backoff_s)


@dataclass(frozen=True)
class ClusterConfig:
    pools: tuple[PoolConfig, ...]
    router: RouterSpec = field(default_factory=RouterSpec)
    ray_address: str | None = None
    ray_num_cpus: float | None = None
    placement: str = "PACK"
    secret_file: str | None = None  # None: $DENSA_CLUSTER_SECRET, else a new one
    serve_args: tuple[str, ...] = ()
    restart: RestartPolicy = field(default_factory=RestartPolicy)

    def pool(self, name: str) -> PoolConfig:
        return next(p for p in self.pools if p.name == name)


def load_config(path: str | Path) -> ClusterConfig:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ClusterConfigError(f"{path} is not valid YAML: {exc}") from None
    return parse_config(raw if raw is not None else {})


def parse_config(raw: Any) -> ClusterConfig:
    keys = {"ray", "placement", "secret_file", "serve_args", "router", "pools", "restart"}
    _mapping(raw, "the file", keys)
    ray = raw.get("ray") or {}
    _mapping(ray, "ray", {"address", "num_cpus"})
    config = ClusterConfig(
        pools=tuple(_pool(p, i) for i, p in enumerate(_list(raw.get("pools"), "pools"))),
        router=_router(raw.get("router") or {}),
        ray_address=_optional_str(ray.get("address"), "ray.address", "a local Ray instance"),
        ray_num_cpus=_optional_number(ray.get("num_cpus"), "ray.num_cpus"),
        placement=str(raw.get("placement", "PACK")).upper(),
        secret_file=_optional_str(raw.get("secret_file"), "secret_file", "a new secret"),
        serve_args=_args(raw.get("serve_args"), "serve_args", _OWN_SERVE_FLAGS),
        restart=_restart(raw.get("restart") or {}),
    )
    _check(config)
    return config


def _pool(raw: Any, index: int) -> PoolConfig:
    where = f"pools[{index}]"
    _mapping(raw, where, {"name", "role", "replicas", "num_cpus", "args"})
    if "name" not in raw:
        raise ClusterConfigError(f"{where} needs a name")
    return PoolConfig(
        name=str(raw["name"]),
        role=str(raw.get("role", "both")),
        replicas=_int(raw.get("replicas", 1), f"{where}.replicas", minimum=0),
        num_cpus=_number(raw.get("num_cpus", 1.0), f"{where}.num_cpus"),
        args=_args(raw.get("args"), f"{where}.args", _OWN_SERVE_FLAGS),
    )


def _router(raw: Any) -> RouterSpec:
    _mapping(raw, "router", {"host", "port", "num_cpus", "args"})
    return RouterSpec(
        host=str(raw.get("host", "127.0.0.1")),
        port=_int(raw.get("port", 8080), "router.port", minimum=1, maximum=65535),
        num_cpus=_number(raw.get("num_cpus", 0.5), "router.num_cpus"),
        args=_args(raw.get("args"), "router.args", _OWN_ROUTER_FLAGS),
    )


def _restart(raw: Any) -> RestartPolicy:
    _mapping(raw, "restart", {"backoff_s", "max_backoff_s"})
    return RestartPolicy(
        backoff_s=_number(raw.get("backoff_s", 1.0), "restart.backoff_s"),
        max_backoff_s=_number(raw.get("max_backoff_s", 30.0), "restart.max_backoff_s"),
    )


def _check(config: ClusterConfig) -> None:
    names = [p.name for p in config.pools]
    if not config.pools:
        raise ClusterConfigError("pools: give at least one pool (e.g. name: chat, replicas: 2)")
    if len(set(names)) != len(names):
        raise ClusterConfigError("pools: each pool needs its own name")
    for pool in config.pools:
        if pool.role not in ROLES:
            raise ClusterConfigError(f"pool {pool.name!r}: role must be one of {', '.join(ROLES)}")
    roles = {p.role for p in config.pools if p.replicas}
    if ("prefill" in roles) != ("decode" in roles):
        raise ClusterConfigError(
            "pools: a prefill pool needs a decode pool and the other way round"
        )
    if not roles:
        raise ClusterConfigError("pools: at least one pool needs replicas >= 1")
    for where, cpus in [("router", config.router.num_cpus),
                        *((f"pool {p.name!r}", p.num_cpus) for p in config.pools)]:  # fmt: skip
        if cpus <= 0:  # a Ray bundle cannot be empty
            raise ClusterConfigError(f"{where}: num_cpus must be a number > 0")
    if config.placement not in STRATEGIES:
        raise ClusterConfigError(f"placement must be one of {', '.join(STRATEGIES)}")


# ---- small typed readers -------------------------------------------------------------------------
def _mapping(raw: Any, where: str, keys: set[str]) -> None:
    if not isinstance(raw, dict):
        raise ClusterConfigError(f"{where} must be a mapping")
    unknown = sorted(set(raw) - keys)
    if unknown:
        raise ClusterConfigError(
            f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(keys))})"
        )


def _list(raw: Any, where: str) -> list[Any]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ClusterConfigError(f"{where} must be a list")
    return raw


def _args(raw: Any, where: str, reserved: tuple[str, ...]) -> tuple[str, ...]:
    args = tuple(str(a) for a in _list(raw, where))
    for arg in args:
        if arg.split("=", 1)[0] in reserved:
            raise ClusterConfigError(
                f"{where}: {arg.split('=', 1)[0]} is set by the cluster itself"
            )
    return args


def _int(raw: Any, where: str, minimum: int, maximum: int | None = None) -> int:
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < minimum:
        raise ClusterConfigError(f"{where} must be an integer >= {minimum}")
    if maximum is not None and raw > maximum:
        raise ClusterConfigError(f"{where} must be an integer <= {maximum}")
    return raw


def _number(raw: Any, where: str) -> float:
    if not isinstance(raw, int | float) or isinstance(raw, bool) or raw < 0:
        raise ClusterConfigError(f"{where} must be a number >= 0")
    return float(raw)


def _optional_number(raw: Any, where: str) -> float | None:
    return None if raw is None else _number(raw, where)


def _optional_str(raw: Any, where: str, null_means: str) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str) or not raw:
        raise ClusterConfigError(f"{where} must be a string (or null for {null_means})")
    return raw
