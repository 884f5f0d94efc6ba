"""`densa cluster up` gives every member one cluster secret: the config's file, else
$DENSA_CLUSTER_SECRET, else a new one written 0600 for members started by hand; each process
spec carries it for its environment (no Ray instance is started here)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from densa.auth.secret import SECRET_ENV, ClusterSecret
from densa.cluster.config import parse_config

pytest.importorskip("ray")
from densa.cluster.supervisor import Cluster

POOLS = {"pools": [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"}]}


def test_a_new_secret_is_written_0600_and_given_to_every_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    lines: list[str] = []
    cluster = Cluster(parse_config(POOLS), str(tmp_path / "logs"), say=lines.append)
    assert cluster.secret_path == tmp_path / "logs" / "cluster-secret"
    assert stat.S_IMODE(cluster.secret_path.stat().st_mode) == 0o600
    assert ClusterSecret.from_file(cluster.secret_path) == cluster.secret
    assert not any(cluster.secret.value.decode() in line for line in lines)
    config = cluster.config
    for pool in config.pools:
        spec = cluster._worker_spec(pool, f"{pool.name}-0")
        assert spec.secret == cluster.secret
        assert not any(cluster.secret.value.decode() in arg for arg in spec.argv)
    other = Cluster(parse_config(POOLS), str(tmp_path / "other"), say=lines.append)
    assert other.secret != cluster.secret  # a new cluster, a new secret


def test_the_configs_secret_file_or_the_environment_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    given, path = ClusterSecret.generate(), tmp_path / "given"
    given.write(path)
    monkeypatch.setenv(SECRET_ENV, ClusterSecret.generate().value.decode())
    cluster = Cluster(parse_config({**POOLS, "secret_file": str(path)}), str(tmp_path), say=print)
    assert cluster.secret == given and cluster.secret_path is None
    assert not (tmp_path / "cluster-secret").exists()
    from_env = ClusterSecret.generate()
    monkeypatch.setenv(SECRET_ENV, from_env.value.decode())
    assert Cluster(parse_config(POOLS), str(tmp_path), say=print).secret == from_env
    with pytest.raises(ValueError, match="cannot read the cluster secret file"):
        Cluster(parse_config({**POOLS, "secret_file": str(tmp_path / "missing")}), str(tmp_path))
