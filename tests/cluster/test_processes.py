"""SupervisedProcess with a real densa process (the torch-free router, quick to start): a life
killed with SIGKILL is restarted on the same port; stop() leaves nothing; a supervisor killed
with SIGKILL takes its child with it (no orphan holding the port)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx

from densa.auth.secret import SECRET_ENV, ClusterSecret
from densa.cluster.config import RestartPolicy
from densa.cluster.processes import ProcessSpec, SupervisedProcess, port_is_free
from tests.processes import pid_gone, wait_for

ROUTER_ARGV = ("router", "--host", "{host}", "--port", "{port}", "--worker", "http://127.0.0.1:9")


def answers(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1)  # 503 (no worker up) is an answer
        return True
    except httpx.HTTPError:
        return False


def test_a_killed_life_is_restarted_on_its_port_and_stop_leaves_nothing(tmp_path: Path) -> None:
    spec = ProcessSpec("router", ROUTER_ARGV, host="127.0.0.1", log_dir=str(tmp_path))
    process = SupervisedProcess(spec, RestartPolicy(backoff_s=0.2, max_backoff_s=1.0))
    process.start()
    try:
        first = process.status()
        assert first.generation == 1 and first.alive and first.pid is not None
        wait_for(lambda: answers(first.url), "the first life answers")
        os.kill(first.pid, signal.SIGKILL)
        wait_for(lambda: process.status().generation == 2 and process.status().alive,
                 "a second life")  # fmt: skip
        second = process.status()
        assert second.url == first.url and second.pid != first.pid
        assert second.last_exit_code == -signal.SIGKILL
        wait_for(lambda: answers(second.url), "the second life answers on the same port")
    finally:
        process.stop(timeout=10)
    status = process.status()
    assert not status.alive and status.pid is not None and pid_gone(status.pid)
    assert port_is_free("127.0.0.1", process.port)
    time.sleep(0.5)  # a stopped process is not restarted
    assert process.status().generation == 2
    log = (tmp_path / "router.log").read_text()
    assert "--- life 1:" in log and "--- life 2:" in log


def test_a_supervisor_killed_with_sigkill_takes_its_process_with_it(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys, time
        from densa.cluster.config import RestartPolicy
        from densa.cluster.processes import ProcessSpec, SupervisedProcess
        spec = ProcessSpec("router", {ROUTER_ARGV!r}, host="127.0.0.1", log_dir={str(tmp_path)!r})
        process = SupervisedProcess(spec, RestartPolicy())
        process.start()
        print(process.status().pid, process.port, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid, port = (int(x) for x in parent.stdout.readline().split())
        wait_for(lambda: answers(f"http://127.0.0.1:{port}"), "the child answers")
        parent.kill()  # SIGKILL: no cleanup code runs in the parent
        parent.wait(10)
        wait_for(lambda: pid_gone(pid), "the orphan died with its parent")
        wait_for(lambda: port_is_free("127.0.0.1", port), "the port is free")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_the_secret_reaches_the_child_by_its_environment_only(tmp_path: Path) -> None:
    """A router with P/D pools starts only with the cluster secret: it answering proves the
    secret arrived; /proc shows it in the environment, not the command line, nor in the log."""
    secret = ClusterSecret.generate()
    argv = ("router", "--host", "{host}", "--port", "{port}",
            "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10")  # fmt: skip
    spec = ProcessSpec("router", argv, host="127.0.0.1", log_dir=str(tmp_path), secret=secret)
    assert secret.value.decode() not in repr(spec)
    process = SupervisedProcess(spec, RestartPolicy(backoff_s=0.2, max_backoff_s=1.0))
    process.start()
    try:
        status = process.status()
        wait_for(lambda: answers(status.url), "the P/D router answers")
        assert process.status().generation == 1  # it did not exit for want of the secret
        assert status.pid is not None
        environ = Path(f"/proc/{status.pid}/environ").read_bytes().split(b"\0")
        assert f"{SECRET_ENV}={secret.value.decode()}".encode() in environ
        assert secret.value not in Path(f"/proc/{status.pid}/cmdline").read_bytes()
    finally:
        process.stop(timeout=10)
    assert secret.value.decode() not in (tmp_path / "router.log").read_text()
