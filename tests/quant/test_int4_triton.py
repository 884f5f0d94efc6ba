"""The Triton INT4 kernel against the torch reference, run on CPU by Triton's interpreter.

Untested on a GPU here: these runs check the kernel's indexing and arithmetic, not its speed.
"""

from __future__ import annotations

import os
from types import ModuleType

import pytest
import torch

from densa.kernels.cpu.int4_linear import int4_linear_ref
from densa.quant import int4
from densa.quant.weight_format import WeightFormat

if not torch.cuda.is_available():
    # Triton decides at import time (its own helpers) and at decoration time (our kernel) whether
    # to interpret, so this must be set before either is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    import densa.kernels.triton.int4_linear as module

    return module


@pytest.mark.parametrize(
    ("out_features", "in_features", "group_size", "symmetric", "dtype"),
    [
        (48, 96, 32, True, torch.float32),
        (40, 72, 64, False, torch.float32),  # partial tiles and a partial last group
        (33, 80, 32, False, torch.float16),
        (64, 576, 128, True, torch.float32),  # SmolLM2's K: 4.5 groups of 128
    ],
)
@pytest.mark.parametrize("rows", [1, 5])
def test_triton_int4_matches_the_reference(
    kernels: ModuleType,
    out_features: int,
    in_features: int,
    group_size: int,
    symmetric: bool,
    dtype: torch.dtype,
    rows: int,
) -> None:
    gen = torch.Generator().manual_seed(rows)
    fmt = WeightFormat("int4", group_size=group_size, symmetric=symmetric)
    parts = int4.quantize_rtn(torch.randn(out_features, in_features, generator=gen), fmt)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    args = (parts["qweight"], parts["scales"], parts.get("zeros"), group_size, bias)
    got = kernels.int4_linear_triton(x, *args)
    expected = int4_linear_ref(x, *args)
    assert got.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance * 30, rtol=tolerance)
