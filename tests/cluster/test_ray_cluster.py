"""densa cluster on a local Ray instance, for real: the router and two workers (each a densa
serve process with its engine process) as Ray actors in one placement group. Through the
official openai client: traffic is served; a worker killed with SIGKILL is restarted by its
actor on the same URL and re-admitted, with no request lost without an explicit error; an actor
killed is restarted by Ray on a new port and the router follows the membership change; down()
leaves no process behind."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import ray

from densa.auth.secret import SECRET_ENV
from densa.cluster.config import parse_config
from densa.cluster.processes import port_is_free
from densa.cluster.supervisor import Cluster
from tests.processes import pid_gone, wait_for

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # (silences a FutureWarning)
WAIT_S = 60.0  # restarts and admissions, on a busy 2-core machine


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = parse_config({
        "ray": {"num_cpus": 3},
        "serve_args": ["--model", str(tiny_model_dir), "--served-model-name", "tiny",
                       "--kv-cache-memory", "32MiB", "--max-model-len", "256"],
        "router": {"port": _free_port(), "args": ["--poll-interval", "0.2", "--max-backoff", "1",
                                                  "--debug-headers"]},
        "pools": [{"name": "chat", "role": "both", "replicas": 2, "num_cpus": 1}],
        "restart": {"backoff_s": 0.2, "max_backoff_s": 1.0},
    })  # fmt: skip
    lines: list[str] = []
    cluster = Cluster(config, str(tmp_path_factory.mktemp("cluster-logs")), say=lines.append)
    try:
        cluster.up(timeout_s=180)
        yield cluster
    finally:
        members = [m for m in [*cluster.workers, cluster.router] if m and m.status]
        cluster.down()
        # down() drained and stopped every process and freed every port.
        for member in members:
            assert member.status is not None and member.status.pid is not None
            assert pid_gone(member.status.pid), f"{member.name} outlived down()"
            port = int(member.status.url.rsplit(":", 1)[1])
            assert port_is_free("127.0.0.1", port), f"{member.name}'s port is still taken"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def router_url(cluster: Cluster) -> str:
    assert cluster.router is not None and cluster.router.status is not None
    return cluster.router.status.url


def listed(cluster: Cluster) -> dict[str, bool]:
    body = httpx.get(
        router_url(cluster) + "/densa/workers",
        timeout=5,
        headers={"authorization": f"Bearer {cluster.token}"},
    ).json()
    return {w["url"]: w["healthy"] for w in body["workers"]}


def worker_urls(cluster: Cluster) -> set[str]:
    return {m.status.url for m in cluster.workers if m.status}


def complete(cluster: Cluster) -> tuple[str, Any]:
    api = openai.OpenAI(base_url=router_url(cluster) + "/v1", api_key="k", max_retries=0,
                        timeout=60)  # fmt: skip
    raw = api.completions.with_raw_response.create(model="tiny", prompt="The sea", max_tokens=4)
    return raw.headers["x-densa-worker"], raw.parse()


def outcome(cluster: Cluster) -> str:
    """'ok' or the explicit error's status: never a hang (the client times out at 60 s)."""
    try:
        complete(cluster)
        return "ok"
    except openai.APIStatusError as exc:
        return str(exc.status_code)


def test_the_cluster_serves_through_its_router(cluster: Cluster) -> None:
    wait_for(lambda: all(listed(cluster).values()) and len(listed(cluster)) == 2,
             "both workers admitted", WAIT_S)  # fmt: skip
    served = {complete(cluster)[0] for _ in range(6)}
    assert served <= worker_urls(cluster) and served
    assert complete(cluster)[1].usage.completion_tokens == 4
    # Every member got the cluster's secret, in its environment and not on its command line.
    assert cluster.router is not None
    for member in [*cluster.workers, cluster.router]:
        assert member.status is not None and member.status.pid is not None
        proc = Path(f"/proc/{member.status.pid}")
        entry = f"{SECRET_ENV}={cluster.secret.value.decode()}".encode()
        assert entry in (proc / "environ").read_bytes().split(b"\0"), member.name
        assert cluster.secret.value not in (proc / "cmdline").read_bytes()
    assert httpx.get(router_url(cluster) + "/densa/workers", timeout=5).status_code == 401


def test_a_worker_killed_is_restarted_on_its_url_and_traffic_goes_on(cluster: Cluster) -> None:
    victim = cluster.workers[0]
    cluster.refresh()
    assert victim.status is not None and victim.status.pid is not None
    before = victim.status
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(outcome, cluster) for _ in range(4)]
        os.killpg(before.pid, signal.SIGKILL)  # the front and its engine process at once
        futures += [pool.submit(outcome, cluster) for _ in range(12)]
        results = [f.result(timeout=120) for f in futures]
    # Every request got an answer or an explicit error (one streaming on the victim may 502).
    assert all(r == "ok" or r.startswith("5") for r in results), results
    assert results[-8:].count("ok") == 8, results  # once ejected, the other worker serves
    wait_for(lambda: (cluster.refresh(), victim.status)[1].generation > before.generation,
             "the actor started a new life", WAIT_S)  # fmt: skip
    assert victim.status.url == before.url  # same port: the router re-admits the same URL
    wait_for(lambda: listed(cluster).get(before.url) is True, "the restarted worker re-admitted",
             WAIT_S)  # fmt: skip


def test_an_actor_killed_comes_back_and_the_router_follows(cluster: Cluster) -> None:
    victim = cluster.workers[1]
    cluster.refresh()
    assert victim.status is not None
    old_url, old_pid = victim.status.url, victim.status.pid
    ray.kill(victim.actor, no_restart=False)  # the actor process dies; Ray restarts it
    wait_for(lambda: (cluster.refresh(), victim.status)[1].pid != old_pid, "a new actor life",
             timeout=120)  # fmt: skip
    new_url = victim.status.url
    wait_for(lambda: cluster.follow_once() or new_url in listed(cluster), "the router was told",
             WAIT_S)  # fmt: skip
    if new_url != old_url:  # a new port (the old one was still draining): the old URL left
        assert old_url not in listed(cluster)
    wait_for(lambda: listed(cluster).get(new_url) is True, "the new worker admitted", WAIT_S)
    assert old_pid is not None and pid_gone(old_pid)  # the old server died with its actor
    served = {complete(cluster)[0] for _ in range(8)}
    assert served <= worker_urls(cluster)
