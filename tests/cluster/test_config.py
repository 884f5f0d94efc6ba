"""cluster.yaml parsing: a good file, and one clear error per mistake (no Ray needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from densa.cli import main
from densa.cluster.config import ClusterConfigError, RestartPolicy, load_config, parse_config

GOOD = """
ray: {address: null, num_cpus: 4}
placement: spread
secret_file: /etc/densa/cluster-secret
serve_args: [--max-num-seqs, 8]
router: {host: 0.0.0.0, port: 9000, args: [--policy, densa]}
pools:
  - {name: prefill, role: prefill, replicas: 1, num_cpus: 2}
  - {name: decode, role: decode, replicas: 2, args: [--kv-cache-dtype, fp8_e4m3]}
restart: {backoff_s: 0.5, max_backoff_s: 4}
"""


def test_a_full_file_parses_with_every_value(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(GOOD)
    config = load_config(path)
    assert config.placement == "SPREAD" and config.ray_num_cpus == 4
    assert config.secret_file == "/etc/densa/cluster-secret"
    assert config.serve_args == ("--max-num-seqs", "8")
    assert (config.router.host, config.router.port) == ("0.0.0.0", 9000)
    assert [(p.name, p.role, p.replicas, p.num_cpus) for p in config.pools] == [
        ("prefill", "prefill", 1, 2.0), ("decode", "decode", 2, 1.0)]  # fmt: skip
    assert config.pool("decode").args == ("--kv-cache-dtype", "fp8_e4m3")
    assert [config.restart.delay(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1, 2, 4, 4]


def test_check_prints_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(GOOD)
    assert main(["cluster", "check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "pool decode: 2 x densa serve --role decode" in out and "SPREAD" in out
    assert "cluster secret: /etc/densa/cluster-secret" in out


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "at least one pool"),
        ({"pools": [{"role": "both"}]}, "needs a name"),
        ({"pools": [{"name": "a"}, {"name": "a"}]}, "its own name"),
        ({"pools": [{"name": "a", "role": "mixed"}]}, "role must be one of"),
        ({"pools": [{"name": "p", "role": "prefill"}]}, "needs a decode pool"),
        ({"pools": [{"name": "a", "replicas": 0}]}, "replicas >= 1"),
        ({"pools": [{"name": "a", "replicas": "2"}]}, "replicas must be an integer"),
        ({"pools": [{"name": "a", "num_cpus": 0}]}, "num_cpus must be a number > 0"),
        ({"pools": [{"name": "a", "args": ["--port", "1"]}]}, "--port is set by the cluster"),
        ({"pools": [{"name": "a"}], "router": {"args": ["--worker=http://x"]}}, "--worker is set"),
        ({"pools": [{"name": "a"}], "router": {"port": 70000}}, "router.port must be"),
        ({"pools": [{"name": "a"}], "placement": "RANDOM"}, "placement must be one of"),
        ({"pools": [{"name": "a"}], "ray": {"adress": "auto"}}, "unknown key 'adress'"),
        ({"pools": [{"name": "a"}], "pool": []}, "unknown key 'pool'"),
        ({"pools": {"name": "a"}}, "pools must be a list"),
        ({"pools": [{"name": "a"}], "secret_file": 3}, "secret_file must be a string"),
        ({"pools": [{"name": "a", "args": ["--cluster-secret-file", "f"]}]}, "set by the cluster"),
        ({"pools": [{"name": "a"}], "router": {"args": ["--cluster-secret-file=f"]}}, "set by"),
    ],
)
def test_each_mistake_names_its_key(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ClusterConfigError, match=message):
        parse_config(raw)


def test_a_file_that_is_not_yaml_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("pools: [unclosed\n")
    with pytest.raises(ClusterConfigError, match="not valid YAML"):
        load_config(path)


def test_restart_backoff_is_capped() -> None:
    assert RestartPolicy(1.0, 30.0).delay(10) == 30.0
