"""What the CLI's logging setup prints: the server's and the benchmarks' INFO lines alike (a
benchmark's progress is logged under densa_bench.*; without a handler it was silently lost)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging
from densa.utils.logging import configure_logging
configure_logging()
logging.getLogger("densa.engine.x").info("engine line")
logging.getLogger("densa_bench.tiers.runner").info("tiers bench: off, 2 worker(s)")
logging.getLogger("elsewhere").info("not ours")
"""


def test_server_and_benchmark_info_lines_are_printed() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    assert "INFO densa.engine.x: engine line" in done.stderr
    assert "INFO densa_bench.tiers.runner: tiers bench: off, 2 worker(s)" in done.stderr
    assert "not ours" not in done.stderr
