"""The W4A8 / W8A8 C++ kernels against their float64 references, on every code path this CPU
runs (the AVX2 path is forced on AVX-512 machines too), and the packing of densa's INT4 layout
and of Q8_0-like weights."""

from __future__ import annotations

import pytest
import torch

from densa.formats.int4 import dequantize_int4, expand_groups, pack_nibbles
from densa.kernels.cpu import native, qgemm
from densa.quant import int4
from densa.quant.weight_format import WeightFormat
from densa.utils.cpu import cpu_flags

pytestmark = pytest.mark.skipif(not native.is_available(), reason="no C++ compiler / x86 AVX2")


def _paths() -> list[str]:
    flags = cpu_flags()
    paths = ["avx2"]
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        paths.append("avx512_vnni")
    return paths


PATHS = _paths()
# Token counts cover every tile size of both paths (1..8 and remainders), and a prefill chunk.
ROWS = [1, 2, 3, 5, 8, 9, 17, 64]


def _w4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).half().float()
    m = (torch.randn(n, k // 32, generator=gen) * 0.05).half().float()
    return codes, d, m


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows", ROWS)
def test_w4a8_matches_reference(isa: str, rows: int) -> None:
    n, k = 48, 96
    codes, d, m = _w4(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(100 + rows))
    x[0, :32] = 0.0  # an all-zero group: scale 0, must not divide by zero
    packed = qgemm.pack_w4(codes, d, m, isa)
    got = qgemm.quantized_linear(x, packed)
    want = qgemm.w4a8_reference(x, codes, d, m)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows", ROWS)
def test_w8a8_matches_reference(isa: str, rows: int) -> None:
    n, k = 32, 128
    gen = torch.Generator().manual_seed(rows)
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    codes[0, :4] = torch.tensor([127, -127, 127, -127], dtype=torch.int8)  # extremes
    d = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()
    x = torch.randn(rows, k, generator=gen) * 3
    x[:, 0] = 50.0  # a large activation drives codes to +-127 too
    got = qgemm.quantized_linear(x, qgemm.pack_w8(codes, d, isa))
    want = qgemm.w8a8_reference(x, codes, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_paths_agree_on_a_model_shaped_weight() -> None:
    codes, d, m = _w4(3072, 576, seed=7)
    x = torch.randn(4, 576)
    outs = [qgemm.quantized_linear(x, qgemm.pack_w4(codes, d, m, isa)) for isa in PATHS]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_densa_int4_maps_onto_w4(symmetric: bool, group_size: int) -> None:
    """d = s and m = z - 8 s exactly; the only loss is storing m as fp16 (like Q4_1 does), at
    most half an fp16 step of the group's offset."""
    weight = torch.randn(32, 256, generator=torch.Generator().manual_seed(group_size))
    fmt = WeightFormat("int4", group_size=group_size, symmetric=symmetric)
    parts = int4.quantize_rtn(weight, fmt)
    codes, d, m = qgemm.int4_to_w4(
        parts["qweight"], parts["scales"], parts.get("zeros"), group_size, 256
    )
    want = dequantize_int4(parts["qweight"], parts["scales"], parts.get("zeros"), group_size, 256)
    exact = codes.float() * expand_groups(d, 32, 256) + expand_groups(m, 32, 256)
    torch.testing.assert_close(exact, want, rtol=0, atol=1e-6)
    fp16_step = expand_groups(m.abs(), 32, 256) * 2.0**-11 + 1e-7
    assert ((qgemm.dequantize_w4(codes, d, m) - want).abs() <= fp16_step).all()


def test_w8_recovers_q8_0_weights_exactly() -> None:
    """Weights that are Q8_0 blocks (fp16 scale times int8, max |code| 127) come back exactly."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (16, 64), generator=gen, dtype=torch.int8)
    codes[:, 0] = 127  # each group's max code is +-127, as llama.cpp's Q8_0 quantizer makes it
    codes[:, 32] = -127
    d = (torch.rand(16, 2, generator=gen) * 0.01 + 1e-4).half().float()
    weight = qgemm.dequantize_w8(codes, d)
    got_codes, got_d = qgemm.quantize_w8(weight)
    assert torch.equal(got_codes, codes)
    assert torch.equal(got_d, d)


def test_pack_nibbles_round_trip_feeds_the_kernel() -> None:
    codes, d, m = _w4(16, 64, seed=3)
    qweight = pack_nibbles(codes)
    again, _, _ = qgemm.int4_to_w4(qweight, d, m + 8 * d, 32, 64)
    assert torch.equal(again, codes)


def test_forced_isa_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ISA_ENV, "sse9")
    native.isa.cache_clear()
    try:
        with pytest.raises(ValueError, match="DENSA_CPU_ISA"):
            native.isa()
    finally:
        monkeypatch.delenv(native.ISA_ENV)
        native.isa.cache_clear()


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows", ROWS)
def test_weight_only_w8_matches_the_float_product(isa: str, rows: int) -> None:
    """No activation rounding: the float32 product with the stored weights."""
    n, k = 48, 96
    gen = torch.Generator().manual_seed(rows)
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()
    x = torch.randn(rows, k, generator=gen)
    got = qgemm.quantized_linear(x, qgemm.pack_w8_float(codes, d, isa))
    torch.testing.assert_close(got, qgemm.w8_float_reference(x, codes, d), rtol=1e-5, atol=1e-5)
