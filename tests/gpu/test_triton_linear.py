"""Triton INT4 (W4A16) and FP8 block-scaled matmuls against their torch references, for every
tiling path: scale after the product (a K step inside one group) or per weight (groups smaller
than the step), split-K, asymmetric zeros, partial tiles, and the float16 magic-number decode.

bfloat16 activations are left to the GPU check: the interpreter cannot do bfloat16 arithmetic."""

from __future__ import annotations

import pytest
import torch

from densa.kernels.cpu.fp8_linear import fp8_linear_ref
from densa.kernels.cpu.int4_linear import int4_linear_ref
from densa.kernels.triton.fp8_linear import fp8_linear_triton
from densa.kernels.triton.int4_linear import candidate_configs, int4_linear_triton
from densa.kernels.triton.tuning import LaunchConfig, best, m_bucket
from densa.quant import fp8_weights, int4
from densa.quant.weight_format import WeightFormat

SCALE_AFTER = LaunchConfig(16, 32, 64, split_k=1)
PER_WEIGHT = LaunchConfig(16, 32, 128, split_k=1)  # 128-column steps over 64-column groups
SPLIT = LaunchConfig(16, 64, 64, split_k=3)


def _int4_case(
    out_features: int, in_features: int, group: int, symmetric: bool, rows: int, dtype: torch.dtype
):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(rows + in_features)
    fmt = WeightFormat("int4", group_size=group, symmetric=symmetric)
    parts = int4.quantize_rtn(torch.randn(out_features, in_features, generator=gen), fmt)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    return x, (parts["qweight"], parts["scales"], parts.get("zeros"), group, bias)


@pytest.mark.parametrize(
    "config", [SCALE_AFTER, PER_WEIGHT, SPLIT], ids=["scale-after", "per-weight", "split-k"]
)
@pytest.mark.parametrize(("symmetric", "dtype"), [(True, torch.float32), (False, torch.float16)])
def test_int4_matches_the_reference(
    config: LaunchConfig, symmetric: bool, dtype: torch.dtype
) -> None:
    # 40 x 200: partial N and K tiles, a partial last group of 64, an odd number of row tiles.
    x, args = _int4_case(40, 200, 64, symmetric, rows=17, dtype=dtype)
    got = int4_linear_triton(x, *args, config=config)
    expected = int4_linear_ref(x, *args)
    assert got.dtype == dtype
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance * 50, rtol=tolerance)


def test_int4_heuristic_splits_a_gemv() -> None:
    x, args = _int4_case(64, 1024, 128, False, rows=1, dtype=torch.float16)
    picked = candidate_configs(1, 64, 1024, 128, torch.device("cpu"))[0]
    assert picked.split_k > 1 and picked.block_k == 128
    got = int4_linear_triton(x, *args)
    torch.testing.assert_close(got.float(), int4_linear_ref(x, *args).float(), atol=0.05, rtol=1e-2)


def test_tuner_keeps_one_pick_per_bucket() -> None:
    calls: list[LaunchConfig] = []
    configs = [SCALE_AFTER, SPLIT]
    key = ("test", m_bucket(3), 1, 2)
    assert m_bucket(3) == 4 and m_bucket(1) == 1 and m_bucket(64) == 64
    assert best(key, configs, calls.append, torch.device("cpu")) == SCALE_AFTER
    assert best(key, [SPLIT], calls.append, torch.device("cpu")) == SCALE_AFTER
    assert calls == []  # nothing is timed off the GPU


@pytest.mark.parametrize(
    ("block", "rows", "dtype"), [(64, 1, torch.float32), (128, 9, torch.float16)]
)
def test_fp8_matches_the_reference(block: int, rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    parts = fp8_weights.to_runtime(
        fp8_weights.quantize_blocks(torch.randn(72, 300, generator=gen), block), block
    )
    x = torch.randn(rows, 300, generator=gen).to(dtype)
    bias = torch.randn(72, generator=gen).to(dtype)
    args = (parts["weight"], parts["weight_scale"], block, bias)
    got = fp8_linear_triton(x, *args)
    expected = fp8_linear_ref(x, *args)
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance * 50, rtol=tolerance)
