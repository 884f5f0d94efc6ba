"""The Triton KV store against the CPU store (densa.kernels.cpu.kv_store.store_fp8) and plain indexing:
the same bytes and exponents, bit for bit, and padding rows (page id -1) write nowhere."""

from __future__ import annotations

import pytest
import torch

from densa.kernels.cpu.kv_store import store_fp8
from densa.kernels.triton.kv_store import store_kv

PAGES, HEADS, PAGE_SIZE, HEAD_DIM = 6, 3, 4, 16


def _tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """7 tokens from 1e-8 to 1e3 in size, a NaN, an inf and a zero row; the last is padding."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, HEADS, HEAD_DIM, generator=gen) * torch.logspace(-8, 3, 7)[:, None, None]
    x[0, 0, 0], x[1, 1, 3], x[2, 2] = float("nan"), float("inf"), 0.0
    pages = torch.tensor([0, 1, 2, 3, 5, 5, -1])
    offsets = torch.tensor([0, 1, 2, 3, 0, 1, 2])
    return x, pages, offsets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_plain_pages_get_torch_casts(dtype: torch.dtype) -> None:
    x, pages, offsets = _tokens()
    cache = torch.zeros(PAGES, HEADS, PAGE_SIZE, HEAD_DIM, dtype=dtype)
    expected = cache.clone()
    store_kv(cache, None, pages, offsets, x)
    expected[pages[:-1], :, offsets[:-1]] = x[:-1].to(dtype)
    # Exact values (rounded to nearest even); a NaN stays NaN, whatever its payload bits.
    torch.testing.assert_close(cache, expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_fp8_pages_match_the_cpu_store_bit_for_bit(policy: str) -> None:
    x, pages, offsets = _tokens()
    cache = torch.zeros(PAGES, HEADS, PAGE_SIZE, HEAD_DIM, dtype=torch.float8_e4m3fn)
    expected = cache.clone()
    if policy == "static":
        scale = expected_scale = torch.tensor(0.0125)
    else:
        scale = torch.full((PAGES, HEADS, PAGE_SIZE), 99, dtype=torch.int8)
        expected_scale = scale.clone()
    store_kv(cache, scale, pages, offsets, x)
    store_fp8(expected, expected_scale, pages[:-1], offsets[:-1], x[:-1])
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(scale, expected_scale)  # untouched slots keep their 99


def test_e4m3_encoding_equals_torch_cast_everywhere() -> None:
    # Every e4m3 value, the midpoints between neighbours (ties to even) and a dense sweep.
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = codes[torch.isfinite(codes)].sort().values
    values = torch.cat(
        [
            grid,
            (grid[1:] + grid[:-1]) / 2,
            torch.linspace(-448, 448, 20011),
            torch.linspace(-0.03, 0.03, 4011),
        ]
    )
    values = torch.nn.functional.pad(values, (0, -values.numel() % 1024)).view(-1, 1, 1024)
    cache = torch.zeros(values.shape[0], 1, 1, 1024, dtype=torch.float8_e4m3fn)
    rows = torch.arange(values.shape[0])
    store_kv(cache, torch.tensor(1.0), rows, torch.zeros_like(rows), values)
    expected = values.view(-1, 1, 1, 1024).to(torch.float8_e4m3fn)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
