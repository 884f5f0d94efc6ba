"""The fp32 dot-product matmul equals torch's F.linear, and a row's result never depends on the
other rows (batch invariance)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from densa.kernels.cpu.linear import can_stream, linear


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 40])
@pytest.mark.parametrize("shape", [(3072, 576), (576, 1536), (17, 5)])
def test_matches_torch(rows: int, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(*shape, generator=gen)
    x = torch.randn(rows, shape[1], generator=gen)
    bias = torch.randn(shape[0], generator=gen)
    assert can_stream(x, weight)
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(
        linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5
    )


def test_a_row_is_the_same_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 576, generator=gen)
    x = torch.randn(70, 576, generator=gen)
    alone = torch.cat([linear(x[i : i + 1], weight) for i in range(len(x))])
    for rows in (2, 3, 9, 17, 33, 70):
        assert torch.equal(linear(x[:rows], weight), alone[:rows])


def test_other_dtypes_use_torch() -> None:
    weight = torch.randn(8, 4)
    assert not can_stream(torch.randn(1, 4, dtype=torch.bfloat16), weight.bfloat16())
    x = torch.randn(2, 4)
    assert not can_stream(x, weight.t())  # non-contiguous weights fall back too
    torch.testing.assert_close(linear(x, weight.t().contiguous().t()), F.linear(x, weight))
