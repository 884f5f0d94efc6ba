"""The Ray actor that holds one densa process on whichever node Ray placed it.

Ray restarts the actor itself if it dies (max_restarts=-1; the node lost, the actor killed): its
constructor then starts a fresh process, on a new port if need be, and the supervisor notices the
URL change. A process that dies under a live actor is restarted by the actor's own
SupervisedProcess, which is quicker and keeps the URL.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import ray

from densa.cluster.config import RestartPolicy
from densa.cluster.processes import ProcessSpec, ProcessStatus, SupervisedProcess

LOOPBACK = "127.0.0.1"


class ProcessActor:
    """Wrapped by ray.remote in the supervisor (so importing this module starts nothing)."""

    def __init__(self, spec: ProcessSpec, restart: RestartPolicy, public_host: bool) -> None:
        # A local cluster keeps everything on loopback; one spanning machines listens on the
        # node's address so the router (and decode workers) on other nodes reach it.
        if public_host and spec.host in ("", LOOPBACK):
            spec = dataclasses.replace(spec, host=ray.util.get_node_ip_address())
        self.process = SupervisedProcess(spec, restart)
        self.process.start()

    def status(self) -> ProcessStatus:
        return self.process.status()

    def call(self, method: str, path: str, body: Any = None,
             headers: dict[str, str] | None = None) -> tuple[int, Any]:  # fmt: skip
        """An HTTP call to the process from its own node (the router's admin API stays on a
        loopback-reachable socket; the supervisor may be on another machine)."""
        host = self.process.spec.host
        host = LOOPBACK if host in ("0.0.0.0", "") else host
        url = f"http://{host}:{self.process.port}{path}"
        response = httpx.request(method, url, json=body, headers=headers, timeout=10)
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, response.text

    def stop(self) -> None:
        self.process.stop()


RemoteProcessActor = ray.remote(ProcessActor)
