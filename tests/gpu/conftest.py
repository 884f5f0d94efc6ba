"""The GPU kernels, tested on machines without a GPU through Triton's interpreter.

Triton decides at import time (its own helpers) and at decoration time (densa's kernels)
whether to interpret, so the switch is set here, before any test module imports either.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
