"""The FP4 kernels (csrc/fp4gemm.cpp: e2m1 weights with E8M0 / e4m3 block scales; MXFP4A8 and
NVFP4A8 with int8 activations, MXFP4 and NVFP4 weight-only with float32 ones, over the same
blocks) against their float64 references on every code path this CPU runs,
every token tile, the scales' extremes (E8M0 0x00, 0x01, 0xFF = NaN; e4m3 subnormals and NaN),
and NVFP4's tensor scale per row; and the packed blocks' size and byte layout."""

from __future__ import annotations

import pytest
import torch

from densa.formats import fp4
from densa.kernels.cpu import native, qgemm
from densa.model.packed_linear import PackedLinear, packed_bytes, reference_linear
from densa.utils.cpu import cpu_flags

pytestmark = pytest.mark.skipif(not native.is_available(), reason="no C++ compiler / x86 AVX2")

PATHS = ["avx2"] + (
    ["avx512_vnni"] if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_flags() else []
)
ROWS = [1, 4, 5, 9, 17]  # every token tile of both paths (AVX-512: 8, AVX2: 4) and tails
SHAPES = [(32, 16), (160, 48), (1024, 64)]  # (K, N)


def _mxfp4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    codes[0, :32] = 7  # a block of +6s and one of -6s: the table's extremes
    codes[-1, -32:] = 15
    scales = torch.randint(118, 136, (n, k // 32), generator=gen, dtype=torch.uint8)
    return fp4.pack_fp4(codes), scales


def _nvfp4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qweight, _ = _mxfp4(n, k, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    scales = torch.randint(0x20, 0x60, (n, k // 16), generator=gen, dtype=torch.uint8)
    scales[0, 0], scales[-1, -1] = 0x01, 0x07  # subnormal e4m3 scales
    t = torch.rand(n, generator=gen) * 0.01 + 1e-4  # one tensor scale per row
    return qweight, scales, t


def _pack(
    fmt: str, weight: tuple[torch.Tensor, ...], isa: str, int8: bool = True
) -> qgemm.PackedWeight:
    if fmt == "mxfp4":
        return qgemm.pack_mxfp4(*weight, isa, int8)
    return qgemm.pack_nvfp4(*weight, isa, int8)


def _reference(
    fmt: str, x: torch.Tensor, weight: tuple[torch.Tensor, ...], int8: bool = True
) -> torch.Tensor:
    if fmt == "mxfp4":
        return (qgemm.mxfp4a8_reference if int8 else qgemm.mxfp4_float_reference)(x, *weight)
    return (qgemm.nvfp4a8_reference if int8 else qgemm.nvfp4_float_reference)(x, *weight)


def _assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 rounding only: within 1e-5 of the finite outputs' scale; NaN where NaN."""
    scale = want.nan_to_num(0.0).abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, equal_nan=True)


@pytest.mark.parametrize("int8", [True, False], ids=["a8", "weight-only"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}-N{s[1]}")
@pytest.mark.parametrize("rows", ROWS)
def test_fp4_kernels_match_reference(
    fmt: str, isa: str, shape: tuple[int, int], rows: int, int8: bool
) -> None:
    k, n = shape
    weight = (_mxfp4 if fmt == "mxfp4" else _nvfp4)(n, k, seed=rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = qgemm.quantized_linear(x, _pack(fmt, weight, isa, int8))
    _assert_matches(got, _reference(fmt, x, weight, int8))


@pytest.mark.parametrize("int8", [True, False], ids=["a8", "weight-only"])
@pytest.mark.parametrize("isa", PATHS)
def test_e8m0_extremes_in_the_kernel(isa: str, int8: bool) -> None:
    """Scale bytes 0x00 (2^-127) and 0x01 (2^-126: both float32 subnormals once halved for the
    table's 2v) compute exactly as the reference; 0xFF makes its rows NaN, and only them."""
    qweight, scales = _mxfp4(16, 64, seed=3)
    scales[:, 0] = 127
    scales[1, 1], scales[2, 1], scales[3, 1], scales[4, 1] = 0x00, 0x01, 0x02, 0xFF
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    got = qgemm.quantized_linear(x, _pack("mxfp4", (qweight, scales), isa, int8))
    want = _reference("mxfp4", x, (qweight, scales), int8)
    _assert_matches(got, want)
    assert torch.isnan(got[:, 4]).all() and not torch.isnan(got[:, [0, 1, 2, 3, 5]]).any()
    # The tiny blocks' contribution is there, though 2^-100 times smaller than the others'.
    only_tiny = scales.clone()
    only_tiny[:, 0] = 0x00
    tiny = qgemm.quantized_linear(x, _pack("mxfp4", (qweight, only_tiny), isa, int8))
    _assert_matches(tiny[:, :4], _reference("mxfp4", x, (qweight, only_tiny), int8)[:, :4])
    assert (tiny[:, 1] != 0).all() and tiny[:, 1].abs().max() < 1e-36


@pytest.mark.parametrize("int8", [True, False], ids=["a8", "weight-only"])
@pytest.mark.parametrize("isa", PATHS)
def test_a_nan_e4m3_scale_makes_its_rows_nan(isa: str, int8: bool) -> None:
    qweight, scales, t = _nvfp4(16, 32, seed=5)
    scales[2, 1] = 0x7F
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(6))
    got = qgemm.quantized_linear(x, _pack("nvfp4", (qweight, scales, t), isa, int8))
    assert torch.isnan(got[:, 2]).all() and not torch.isnan(got[:, [0, 1, 3]]).any()


def test_packed_sizes_are_the_checkpoints_bits_per_weight() -> None:
    n, k = 64, 256
    assert packed_bytes("mxfp4", n, k) == n * k * 4.25 / 8
    assert packed_bytes("nvfp4", n, k) == n * k * 4.5 / 8 + 4 * n  # + a tensor scale per row
    qweight, scales, t = _nvfp4(n, k, seed=0)
    assert qgemm.pack_nvfp4(qweight, scales, t, PATHS[0]).blocks.numel() == packed_bytes(
        "nvfp4", n, k
    )


def test_block_layout_byte_for_byte() -> None:
    """Block (panel p, group g): nibble byte [64 o + 4 r + j] = code k = 8 o + j (low), 8 o + 4 + j
    (high) of row 16 p + r; then the scales, row by row (NVFP4: half by half)."""
    n, k = 32, 64
    qweight, scales, t = _nvfp4(n, k, seed=7)
    codes = fp4.unpack_fp4(qweight)
    blocks = qgemm.pack_nvfp4(qweight, scales, t, PATHS[0]).blocks
    block = blocks[(1 * (k // 32) + 1) * 288 :][:288]  # panel 1, group 1
    for r in (0, 5, 15):
        row = 16 + r
        for o, j in ((0, 0), (2, 3), (3, 1)):
            byte = int(block[64 * o + 4 * r + j])
            assert byte & 0xF == codes[row, 32 + 8 * o + j]
            assert byte >> 4 == codes[row, 32 + 8 * o + 4 + j]
        assert block[256 + r] == scales[row, 2] and block[256 + 16 + r] == scales[row, 3]
    trailer = blocks[-4 * n :].view(torch.float32)
    assert torch.equal(trailer, t)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp4a8", "nvfp4a8"])
def test_packed_linear_from_dense_weights(fmt: str) -> None:
    """PackedLinear(fmt, dense) quantizes by round-to-nearest and computes its reference."""
    gen = torch.Generator().manual_seed(8)
    weight, x = torch.randn(48, 96, generator=gen), torch.randn(5, 96, generator=gen)
    bias = torch.randn(48, generator=gen)
    layer = PackedLinear(fmt, weight, bias)
    _assert_matches(layer(x), reference_linear(x, weight, fmt) + bias)
