"""The W6A8 kernel (6-bit codes, fp16 scale per 32 and int8 scale per 16 inputs: GGUF's Q6_K)
and W6MA8 (the same plus an fp16 minimum per 32: Q5_1, Q5_K) against their float64 references
on every code path this CPU runs, their block layouts byte for byte, and sharded projections
(shards of different formats side by side, written in place)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from densa.kernels.cpu import native, qgemm
from densa.model.packed_linear import (
    PackedLinear,
    ShardedPackedLinear,
    packed_bytes,
    reference_linear,
)
from densa.utils.cpu import cpu_flags

pytestmark = pytest.mark.skipif(not native.is_available(), reason="no C++ compiler / x86 AVX2")

PATHS = ["avx2"] + (
    ["avx512_vnni"] if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_flags() else []
)
# Every token tile of both paths (AVX-512: 8, AVX2: 4) and remainders.
ROWS = [1, 2, 3, 7, 8, 9, 17]
SHAPES = [(32, 16), (160, 48), (1024, 512), (4096, 64)]  # (K, N)


def _w6(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes, d and sc, with the extremes of each: codes -32 / 31, sc -128 / 127."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8)
    codes[0, :16], codes[-1, -16:] = -32, 31  # whole halves at the extremes
    codes[:, 0] = -32
    d = (torch.rand(n, k // 32, generator=gen) * 1e-3 + 1e-5).half().float()
    sc = torch.randint(-128, 128, (n, k // 16), generator=gen, dtype=torch.int8)
    sc[0, 0], sc[-1, -1] = -128, 127
    sc[:, -1] = 127
    return codes, d, sc


def _w6m(n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """_w6's codes, d and sc plus minimums: zero, both signs, and large next to small d."""
    codes, d, sc = _w6(n, k, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    m = (torch.randn(n, k // 32, generator=gen) * 0.05).half().float()
    m[0] = 0.0
    m[:, 0] = 1.5  # the group whose first code is -32: m dominates
    m[-1, -1] = -2.0
    return codes, d, sc, m


def _pack(fmt: str, weight: tuple[torch.Tensor, ...], isa: str) -> qgemm.PackedWeight:
    return qgemm.pack_w6m(*weight, isa) if fmt == "w6ma8" else qgemm.pack_w6(*weight, isa)


def _reference(fmt: str, x: torch.Tensor, weight: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if fmt == "w6ma8":
        return qgemm.w6ma8_reference(x, *weight)
    return qgemm.w6a8_reference(x, *weight)


def _assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 rounding only: within 1e-5 of the output's scale."""
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("fmt", ["w6a8", "w6ma8"])
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}-N{s[1]}")
@pytest.mark.parametrize("rows", ROWS)
def test_w6a8_matches_reference(fmt: str, isa: str, shape: tuple[int, int], rows: int) -> None:
    k, n = shape
    weight = (_w6m if fmt == "w6ma8" else _w6)(n, k, seed=rows + k)
    gen = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, k, generator=gen)
    x[0, :32] = 0.0  # an all-zero group: scale 0, must not divide by zero
    x[-1, 16:32] = 0.0  # an all-zero half
    x[:, -1] = 40.0  # a large activation drives qx to +-127
    got = qgemm.quantized_linear(x, _pack(fmt, weight, isa))
    _assert_matches(got, _reference(fmt, x, weight))


def _pack_reference(codes: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> np.ndarray:
    """The W6 block layout of csrc/qgemm.cpp, written out element by element."""
    n, k = codes.shape
    u = (codes.numpy().astype(np.int32) + 32).reshape(n // 16, 16, k // 32, 32)
    d16 = d.half().numpy().view(np.uint8).reshape(n // 16, 16, k // 32, 2)
    scales = sc.numpy().view(np.uint8).reshape(n // 16, 16, k // 32, 2)
    out = np.zeros((n // 16, k // 32, 448), dtype=np.uint8)
    for p in range(n // 16):
        for g in range(k // 32):
            blk = out[p, g]
            for r in range(16):
                q = u[p, r, g]
                for o in range(4):
                    for j in range(4):
                        blk[64 * o + 4 * r + j] = (q[8 * o + j] & 15) | (q[8 * o + 4 + j] & 15) << 4
                for half in range(2):
                    for j in range(4):
                        bits = [(q[16 * half + 4 * i + j] >> 4) << (2 * i) for i in range(4)]
                        blk[256 + 64 * half + 4 * r + j] = sum(bits)
                    blk[384 + 16 * half + r] = scales[p, r, g, half]
                blk[416 + 2 * r : 418 + 2 * r] = d16[p, r, g]
    return out.reshape(-1)


def test_pack_w6_writes_the_documented_layout() -> None:
    codes, d, sc = _w6(32, 64, seed=5)
    blocks = qgemm.pack_w6(codes, d, sc, PATHS[0]).blocks
    assert blocks.numel() == packed_bytes("w6a8", 32, 64)
    assert np.array_equal(blocks.numpy(), _pack_reference(codes, d, sc))


def test_pack_w6m_is_w6_blocks_with_the_minimums_after_each() -> None:
    codes, d, sc, m = _w6m(32, 64, seed=6)
    blocks = qgemm.pack_w6m(codes, d, sc, m, PATHS[0]).blocks
    assert blocks.numel() == packed_bytes("w6ma8", 32, 64) == 2 * 2 * 480
    got = blocks.numpy().reshape(2, 2, 480)  # [panel, group, bytes]
    assert np.array_equal(got[..., :448].reshape(-1), _pack_reference(codes, d, sc))
    m16 = m.half().numpy().view(np.uint8).reshape(2, 16, 2, 2).transpose(0, 2, 1, 3)
    assert np.array_equal(got[..., 448:], m16.reshape(2, 2, 32))


def test_pack_w6_refuses_codes_out_of_range() -> None:
    codes, d, sc = _w6(16, 32, seed=0)
    codes[3, 7] = 32
    with pytest.raises(RuntimeError, match=r"-32\.\.31"):
        qgemm.pack_w6(codes, d, sc, PATHS[0])


def test_q5_0_and_q4_0_fit_exactly() -> None:
    """GGUF's Q5_0 (d (q - 16), q 5 bits) and Q4_0 (d (q - 8)) are W6 with sc = 1."""
    gen = torch.Generator().manual_seed(0)
    d = (torch.rand(16, 2, generator=gen) * 0.01).half().float()
    ones = torch.ones(16, 4, dtype=torch.int8)
    for bits, offset in ((5, 16), (4, 8)):
        q = torch.randint(0, 2**bits, (16, 64), generator=gen)
        want = (q - offset).float() * d.repeat_interleave(32, dim=1)
        got = qgemm.dequantize_w6((q - offset).to(torch.int8), d, ones)
        assert torch.equal(got, want)


def test_q5_1_fits_w6m_exactly() -> None:
    """GGUF's Q5_1 (d q + m, q 5 bits) is W6M with sc = 1 and codes q (u = q + 32)."""
    gen = torch.Generator().manual_seed(1)
    d = (torch.rand(16, 2, generator=gen) * 0.01).half().float()
    m = (torch.randn(16, 2, generator=gen) * 0.1).half().float()
    q = torch.randint(0, 32, (16, 64), generator=gen)
    want = q.float() * d.repeat_interleave(32, dim=1) + m.repeat_interleave(32, dim=1)
    got = qgemm.dequantize_w6m(q.to(torch.int8), d, torch.ones(16, 4, dtype=torch.int8), m)
    assert torch.equal(got, want)


def test_quantize_w6_recovers_w6_weights() -> None:
    """Weights whose every 16 has a -32 code (their largest magnitude) and whose every group has
    a scale of +-127 come back as the same codes, d and sc."""
    codes, d, sc = _w6(16, 128, seed=9)
    codes = codes.clamp(-31, 31)
    codes[:, ::16] = -32
    sc = torch.where(sc == 0, torch.ones_like(sc), sc).clamp(-127, 127)
    sc[:, ::2] = 127
    sc[:, 1::4] = -127
    got = qgemm.quantize_w6(qgemm.dequantize_w6(codes, d, sc))
    assert torch.equal(got[0], codes) and torch.equal(got[1], d) and torch.equal(got[2], sc)


@pytest.mark.parametrize("fmt, bits, block", [("w6a8", 6, 448), ("w6ma8", 7, 480)])
def test_packed_linear_w6a8(fmt: str, bits: int, block: int) -> None:
    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(48, 96, generator=gen) * 0.1, torch.randn(48, generator=gen)
    weight[:16] += 0.3  # rows whose groups sit off zero: W6M's minimum carries them
    layer = PackedLinear(fmt, weight, bias)
    assert layer.bits == bits and layer.blocks.numel() == 3 * 3 * block
    x = torch.randn(2, 3, 96, generator=gen)
    want = reference_linear(x.reshape(-1, 96), weight, fmt).view(2, 3, 48) + bias
    _assert_matches(layer(x), want)
    empty = PackedLinear.empty(fmt, 96, 48, bias=False)
    assert empty.blocks.shape == layer.blocks.shape and empty.bias is None


def test_sharded_linear_is_its_shards_side_by_side() -> None:
    gen = torch.Generator().manual_seed(3)
    k, formats, outs = (
        128,
        ("w4a8", "w6a8", "w8a8", "w6ma8", "w5a8", "w5ma8"),
        (64, 32, 48, 16, 32, 16),
    )
    weights = [torch.randn(out, k, generator=gen) * 0.1 for out in outs]
    bias = torch.randn(sum(outs), generator=gen)
    shards = [PackedLinear(fmt, w, None) for fmt, w in zip(formats, weights, strict=True)]
    layer = ShardedPackedLinear(shards, bias)
    assert (layer.in_features, layer.out_features) == (k, 208)
    x = torch.randn(5, k, generator=gen)
    want = torch.cat([reference_linear(x, w, f) for w, f in zip(weights, formats, strict=True)], -1)
    _assert_matches(layer(x), want + bias)
    empty = ShardedPackedLinear.empty(formats, k, outs, bias=True)
    assert [s.fmt for s in empty.packed_shards] == list(formats)
    assert empty.out_features == 208 and empty.bias is not None


def test_sharded_linear_refuses_mismatched_shards() -> None:
    weight = torch.randn(16, 64)
    with pytest.raises(ValueError, match="same inputs"):
        ShardedPackedLinear(
            [PackedLinear("w4a8", weight, None), PackedLinear("w6a8", weight[:, :32], None)], None
        )
    with pytest.raises(ValueError, match="without biases"):
        ShardedPackedLinear([PackedLinear("w4a8", weight, torch.zeros(16))], None)


# ---- sharded projections in the C++ decoder ----------------------------------------------------
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
Q_SIZE, KV_SIZE = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM


def _decoder(isa: str, qkv: tuple) -> object:
    """A one-layer C++ decoder whose RoPE is the identity (cos 1, sin 0) and norms are ones, so
    its qkv() is qkv_proj(rmsnorm(x))."""
    ext = native.load()
    assert ext is not None
    gen = torch.Generator().manual_seed(0)
    inter = 128
    decoder = ext.Decoder(
        (HIDDEN, inter, HEADS, KV_HEADS, HEAD_DIM, 1e-5), isa, torch.randn(10, HIDDEN),
        torch.ones(HIDDEN), torch.ones(16, HEAD_DIM), torch.zeros(16, HEAD_DIM), native.fp8_table(),
    )  # fmt: skip

    def dense(out: int, inp: int) -> tuple:
        return (32, torch.randn(out, inp, generator=gen) * 0.1, None, out, inp)

    cache = torch.zeros(4, KV_HEADS, 4, HEAD_DIM)
    decoder.add_layer(
        torch.ones(HIDDEN), torch.ones(HIDDEN), qkv, dense(HIDDEN, Q_SIZE),
        dense(2 * inter, HIDDEN), dense(HIDDEN, inter), cache, None, cache.clone(), None, None,
    )  # fmt: skip
    return decoder


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows", [1, 3, 12])
@pytest.mark.parametrize("v_fmt", ["w6a8", "w6ma8", "w5a8", "w5ma8"])
def test_decoder_writes_each_shard_in_place(isa: str, rows: int, v_fmt: str) -> None:
    """qkv = [q dense | k weight-only W8 | v in a split format (W6A8, W6MA8, W5A8, W5MA8)]
    against one dense projection of the same (dequantized) weights. The inputs are +-1, so the
    normalized rows are +-c and quantize to +-127 exactly: the split formats then compute the
    float product too. 12 rows take the dense GEMM path (a strided output), fewer the streaming
    one."""
    gen = torch.Generator().manual_seed(rows)
    wq = torch.randn(Q_SIZE, HIDDEN, generator=gen) * 0.1
    k_codes, k_d = qgemm.quantize_w8(torch.randn(KV_SIZE, HIDDEN, generator=gen) * 0.1)
    bias = torch.randn(Q_SIZE + 2 * KV_SIZE, generator=gen)
    k_blocks = qgemm.pack_w8_float(k_codes, k_d, isa).blocks
    v_packed, v_dense = _split_weight(v_fmt, rows, isa)
    shards = [
        (32, wq, Q_SIZE),
        (qgemm.W8_FLOAT, k_blocks, KV_SIZE),
        (v_packed.bits, v_packed.blocks, KV_SIZE),
    ]
    sharded = _decoder(isa, (shards, bias, Q_SIZE + 2 * KV_SIZE, HIDDEN))
    weight = torch.cat([wq, qgemm.dequantize_w8(k_codes, k_d), v_dense])
    dense = _decoder(isa, (32, weight, bias, weight.shape[0], HIDDEN))
    x = torch.randint(0, 2, (rows, HIDDEN), generator=gen).float() * 2 - 1
    args = (torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long))
    slots = torch.arange(rows) % 4
    got = sharded.qkv(0, x, args[0], args[1], slots)  # type: ignore[attr-defined]
    want = dense.qkv(0, x, args[0], args[1], slots)  # type: ignore[attr-defined]
    _assert_matches(got, want)


def _split_weight(fmt: str, seed: int, isa: str) -> tuple[qgemm.PackedWeight, torch.Tensor]:
    """A [KV_SIZE, HIDDEN] weight in a split format, packed and dequantized."""
    if fmt in ("w5a8", "w5ma8"):
        from tests.kernels.test_w5a8 import _pack as pack_w5
        from tests.kernels.test_w5a8 import _w5

        weight = _w5(fmt, KV_SIZE, HIDDEN, seed)
        packed = pack_w5(fmt, weight, isa)
    else:
        weight = (_w6m if fmt == "w6ma8" else _w6)(KV_SIZE, HIDDEN, seed)
        packed = _pack(fmt, weight, isa)
    dense = qgemm.dequantize_w6m(*weight) if len(weight) == 4 else qgemm.dequantize_w6(*weight)
    return packed, dense


def test_decoder_refuses_shards_that_do_not_add_up() -> None:
    shards = [(32, torch.zeros(Q_SIZE, HIDDEN), Q_SIZE)]
    with pytest.raises(RuntimeError, match="add up"):
        _decoder(PATHS[0], (shards, None, Q_SIZE + 2 * KV_SIZE, HIDDEN))


@pytest.mark.parametrize("fmt", ["w6a8", "w6ma8"])
@pytest.mark.parametrize("isa", PATHS[-1:])
def test_w6a8_linear_releases_the_gil(isa: str, fmt: str) -> None:
    from tests.kernels.test_gil_release import _assert_releases_the_gil

    weight = _pack(fmt, (_w6m if fmt == "w6ma8" else _w6)(2048, 2048, seed=0), isa)
    gen = torch.Generator().manual_seed(0)

    def make(n_calls: int) -> Callable[[], object]:
        x = torch.randn(64 * n_calls, 2048, generator=gen)  # rows: the work of one call
        return lambda: qgemm.quantized_linear(x, weight)

    _assert_releases_the_gil(make)
