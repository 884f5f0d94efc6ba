"""`densa bench memory`'s bookkeeping: which RSS samples it keeps, and what it reads from /proc."""

from __future__ import annotations

import os
import sys

import pytest

from densa_bench.memory.runner import changes, smaps_rollup
from densa_bench.peers.servers import status_kib

MIB = 2**20


def test_changes_keep_the_first_sample_each_move_of_a_mib_and_each_new_phase() -> None:
    samples = [
        (0.0, "load", {1: 10 * MIB}),
        (0.1, "load", {1: 10 * MIB + 1000}),  # less than a MiB: dropped
        (0.2, "load", {1: 11 * MIB}),  # a MiB since the last kept one
        (0.3, "load", {1: 11 * MIB, 2: 5 * MIB}),  # a new process
        (0.4, "load", {1: 11 * MIB, 2: 5 * MIB}),
        (0.5, "wave 1", {1: 11 * MIB, 2: 5 * MIB}),  # same sizes, new phase
        (0.6, "wave 1", {1: 11 * MIB, 2: 4 * MIB}),  # a fall counts as a move
    ]
    assert [s["s"] for s in changes(samples)] == [0.0, 0.2, 0.3, 0.5, 0.6]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_this_process_s_memory_reads_as_rss_and_its_make_up() -> None:
    rollup = smaps_rollup(os.getpid())
    assert rollup["Rss"] == rollup["Anonymous"] + rollup.get("Shmem", 0) + rollup["file-backed"]
    assert status_kib(os.getpid(), "VmHWM") * 1024 >= rollup["Rss"] > 0
    assert smaps_rollup(2**22 + 1) == {} and status_kib(2**22 + 1, "VmRSS") == 0  # no such pid
