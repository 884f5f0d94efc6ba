"""Helpers for tests that start and kill real processes."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path


def pid_gone(pid: int) -> bool:
    """The process exited (a zombie, not yet reaped by its parent, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def wait_for(condition: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    """Poll `condition` until it is truthy; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)
