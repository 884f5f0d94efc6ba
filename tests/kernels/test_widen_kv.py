"""The decode attention's widening of cached K/V bytes to float32, on every code path, against
torch's own conversions: every e4m3 code (subnormals, both signs, the largest), every int8 code,
bf16 bits, with a scale, and lengths that leave a tail below a vector."""

from __future__ import annotations

import pytest
import torch

from densa.kernels.cpu import native
from densa.utils.cpu import cpu_flags

pytestmark = pytest.mark.skipif(not native.is_available(), reason="no C++ kernels here")

PATHS = ["avx2"] + (
    ["avx512_vnni"] if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_flags() else []
)
F32, BF16, FP8, INT8 = 0, 1, 2, 3  # csrc/decoder.h: kKvF32 ... kKvInt8
SCALE = 0.375


def _widen(raw: torch.Tensor, dtype: int, isa: str) -> torch.Tensor:
    ext = native.load()
    assert ext is not None
    return ext.widen_kv(raw.contiguous(), dtype, SCALE, native.fp8_table(), isa)


@pytest.mark.parametrize("isa", PATHS)
def test_every_e4m3_code_widens_exactly(isa: str) -> None:
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # no NaN
    expected = codes.view(torch.float8_e4m3fn).float() * SCALE
    got = _widen(codes, FP8, isa)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    value = dict(zip(codes.tolist(), got.tolist(), strict=True))
    assert value[0x01] == 2.0**-9 * SCALE and value[0x7E] == 448 * SCALE  # subnormal, largest
    assert value[0x83] == -3 * 2.0**-9 * SCALE and value[0x08] == 2.0**-6 * SCALE


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("n", [64, 67, 5])
def test_int8_bf16_and_f32_rows_widen_exactly(isa: str, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    int8 = torch.randint(-127, 128, (n,), generator=gen, dtype=torch.int8)
    torch.testing.assert_close(_widen(int8, INT8, isa), int8.float() * SCALE, rtol=0, atol=0)
    bf16 = torch.randn(n, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(_widen(bf16, BF16, isa), bf16.float() * SCALE, rtol=0, atol=0)
    f32 = torch.randn(n, generator=gen)
    torch.testing.assert_close(_widen(f32, F32, isa), f32 * SCALE, rtol=0, atol=0)
    fp8 = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    fp8[(fp8 & 0x7F) == 0x7F] = 0x7E
    expected = fp8.view(torch.float8_e4m3fn).float() * SCALE
    torch.testing.assert_close(_widen(fp8, FP8, isa), expected, rtol=0, atol=0)
