"""The W5A8 kernel (W6A8 with 5-bit codes: GGUF's Q5_0, Q3_K, Q4_0) and W5MA8 (W6MA8 with 5-bit
unsigned codes: Q5_1, Q5_K) against their float64 references on every code path this CPU runs,
their block layouts byte for byte, and against W6 computing the very same codes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from densa.kernels.cpu import native, qgemm
from densa.model.packed_linear import PackedLinear, packed_bytes, reference_linear
from tests.kernels.test_w6a8 import PATHS, SHAPES, _assert_matches

pytestmark = pytest.mark.skipif(not native.is_available(), reason="no C++ compiler / x86 AVX2")

ROWS = [1, 3, 8, 9, 17]  # one token, the tiles of both paths (AVX-512: 8, AVX2: 4), remainders
CODES = {"w5a8": (-16, 15), "w5ma8": (0, 31)}  # W5M's codes are unsigned, as the files store them


def _w5(fmt: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random codes, d, sc (and m for w5ma8), with the extremes of each: whole halves at the
    lowest and highest code, sc -128 / 127, m zero, large and negative."""
    low, high = CODES[fmt]
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(low, high + 1, (n, k), generator=gen, dtype=torch.int8)
    codes[0, :16], codes[-1, -16:] = low, high
    codes[:, 0] = low
    d = (torch.rand(n, k // 32, generator=gen) * 1e-3 + 1e-5).half().float()
    sc = torch.randint(-128, 128, (n, k // 16), generator=gen, dtype=torch.int8)
    sc[0, 0], sc[-1, -1] = -128, 127
    sc[:, -1] = 127
    if fmt == "w5a8":
        return codes, d, sc
    m = (torch.randn(n, k // 32, generator=gen) * 0.05).half().float()
    m[0] = 0.0
    m[:, 0] = 1.5
    m[-1, -1] = -2.0
    return codes, d, sc, m


def _pack(fmt: str, weight: tuple[torch.Tensor, ...], isa: str) -> qgemm.PackedWeight:
    return qgemm.pack_w5m(*weight, isa) if fmt == "w5ma8" else qgemm.pack_w5(*weight, isa)


def _reference(fmt: str, x: torch.Tensor, weight: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if fmt == "w5ma8":
        return qgemm.w6ma8_reference(x, *weight)
    return qgemm.w6a8_reference(x, *weight)


@pytest.mark.parametrize("fmt", list(CODES))
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}-N{s[1]}")
@pytest.mark.parametrize("rows", ROWS)
def test_w5a8_matches_reference(fmt: str, isa: str, shape: tuple[int, int], rows: int) -> None:
    k, n = shape
    weight = _w5(fmt, n, k, seed=rows + k)
    gen = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, k, generator=gen)
    x[0, :32] = 0.0  # an all-zero group: scale 0, must not divide by zero
    x[-1, 16:32] = 0.0  # an all-zero half
    x[:, -1] = 40.0  # a large activation drives qx to +-127
    got = qgemm.quantized_linear(x, _pack(fmt, weight, isa))
    _assert_matches(got, _reference(fmt, x, weight))


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("fmt, twin", [("w5a8", "w6a8"), ("w5ma8", "w6ma8")])
def test_w5_computes_what_w6_computes_from_the_same_codes(fmt: str, twin: str, isa: str) -> None:
    """5-bit codes fit W6 too: both kernels' integer sums are the same integers (only the codes'
    offset differs, and it is taken off exactly), so the outputs are equal bit for bit."""
    weight = _w5(fmt, 64, 512, seed=7)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(8))
    got = qgemm.quantized_linear(x, _pack(fmt, weight, isa))
    pack_twin = qgemm.pack_w6m if twin == "w6ma8" else qgemm.pack_w6
    assert torch.equal(got, qgemm.quantized_linear(x, pack_twin(*weight, isa)))


def _pack_reference(codes: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, offset: int):
    """The W5 block layout of csrc/qgemm.cpp, written out element by element."""
    n, k = codes.shape
    u = (codes.numpy().astype(np.int32) + offset).reshape(n // 16, 16, k // 32, 32)
    d16 = d.half().numpy().view(np.uint8).reshape(n // 16, 16, k // 32, 2)
    scales = sc.numpy().view(np.uint8).reshape(n // 16, 16, k // 32, 2)
    out = np.zeros((n // 16, k // 32, 384), dtype=np.uint8)
    for p in range(n // 16):
        for g in range(k // 32):
            blk = out[p, g]
            for r in range(16):
                q = u[p, r, g]
                for o in range(4):
                    for j in range(4):
                        blk[64 * o + 4 * r + j] = (q[8 * o + j] & 15) | (q[8 * o + 4 + j] & 15) << 4
                for j in range(4):
                    blk[256 + 4 * r + j] = sum((q[4 * i + j] >> 4) << i for i in range(8))
                for half in range(2):
                    blk[320 + 16 * half + r] = scales[p, r, g, half]
                blk[352 + 2 * r : 354 + 2 * r] = d16[p, r, g]
    return out.reshape(-1)


def test_pack_w5_writes_the_documented_layout() -> None:
    codes, d, sc = _w5("w5a8", 32, 64, seed=5)
    blocks = qgemm.pack_w5(codes, d, sc, PATHS[0]).blocks
    assert blocks.numel() == packed_bytes("w5a8", 32, 64) == 2 * 2 * 384
    assert np.array_equal(blocks.numpy(), _pack_reference(codes, d, sc, offset=16))


def test_pack_w5m_is_w5_blocks_of_unshifted_codes_with_the_minimums_after_each() -> None:
    codes, d, sc, m = _w5("w5ma8", 32, 64, seed=6)
    blocks = qgemm.pack_w5m(codes, d, sc, m, PATHS[0]).blocks
    assert blocks.numel() == packed_bytes("w5ma8", 32, 64) == 2 * 2 * 416
    got = blocks.numpy().reshape(2, 2, 416)  # [panel, group, bytes]
    assert np.array_equal(got[..., :384].reshape(-1), _pack_reference(codes, d, sc, offset=0))
    m16 = m.half().numpy().view(np.uint8).reshape(2, 16, 2, 2).transpose(0, 2, 1, 3)
    assert np.array_equal(got[..., 384:], m16.reshape(2, 2, 32))


@pytest.mark.parametrize(
    "fmt, bad, message", [("w5a8", 16, r"-16\.\.15"), ("w5ma8", -1, r"0\.\.31")]
)
def test_pack_w5_refuses_codes_out_of_range(fmt: str, bad: int, message: str) -> None:
    weight = _w5(fmt, 16, 32, seed=0)
    weight[0][3, 7] = bad
    with pytest.raises(RuntimeError, match=message):
        _pack(fmt, weight, PATHS[0])


def test_quantize_w5_recovers_w5_weights() -> None:
    """Weights whose every 16 has a -16 code (their largest magnitude) and whose every group has
    a scale of +-127 come back as the same codes, d and sc."""
    codes, d, sc = _w5("w5a8", 16, 128, seed=9)
    codes = codes.clamp(-15, 15)
    codes[:, ::16] = -16
    sc = torch.where(sc == 0, torch.ones_like(sc), sc).clamp(-127, 127)
    sc[:, ::2] = 127
    sc[:, 1::4] = -127
    got = qgemm.quantize_w5(qgemm.dequantize_w6(codes, d, sc))
    assert torch.equal(got[0], codes) and torch.equal(got[1], d) and torch.equal(got[2], sc)


def test_quantize_w5m_codes_span_each_half_from_the_groups_minimum() -> None:
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(4)) * 0.1 + 0.05
    codes, d, sc, m = qgemm.quantize_w5m(weight)
    assert codes.min() == 0 and codes.max() == 31 and bool((sc >= 0).all())
    error = (qgemm.dequantize_w6m(codes, d, sc, m) - weight).abs()
    step = (d.repeat_interleave(2, dim=1) * sc.float()).repeat_interleave(16, dim=1)
    assert bool((error <= 0.51 * step + 1e-3 * weight.abs().max()).all())


@pytest.mark.parametrize("fmt, bits, block", [("w5a8", 5, 384), ("w5ma8", 51, 416)])
def test_packed_linear_w5a8(fmt: str, bits: int, block: int) -> None:
    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(48, 96, generator=gen) * 0.1, torch.randn(48, generator=gen)
    weight[:16] += 0.3  # rows whose groups sit off zero: W5M's minimum carries them
    layer = PackedLinear(fmt, weight, bias)
    assert layer.bits == bits and layer.blocks.numel() == 3 * 3 * block
    x = torch.randn(2, 3, 96, generator=gen)
    want = reference_linear(x.reshape(-1, 96), weight, fmt).view(2, 3, 48) + bias
    _assert_matches(layer(x), want)
