"""MXFP4 and NVFP4 (densa.formats.fp4) against the formats' definitions, on every code and every
scale byte: E2M1 elements, E8M0 scales with their extremes (0x00 = 2^-127, 0xFF = NaN: the OCP MX
spec v1.0, secs. 5.3.3, 5.4.1 and 6.3), e4m3 block scales times a float32 tensor scale (NVFP4's
two levels, multiplied as ModelOpt does or divided as compressed-tensors does). Expected values
are computed here in Python floats from the bit fields and rounded to float32 once per product,
and compared bit for bit (so -0.0, subnormals, Inf and NaN all count)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from densa.formats import fp4


def _e2m1_definition(code: int) -> float:
    """sign | 2 exponent bits (bias 1) | 1 mantissa bit; exponent 0 is subnormal (m * 0.5)."""
    sign = -1.0 if code & 0x8 else 1.0
    exponent, mantissa = (code >> 1) & 0x3, code & 0x1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * (1 + mantissa / 2) * 2.0 ** (exponent - 1)


def _e4m3_definition(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 15 and mantissa == 7:
        return math.nan
    if exponent == 0:
        return sign * mantissa * 2.0**-9
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def _bits(values: torch.Tensor) -> np.ndarray:
    """float32 values as their bit patterns, every NaN as one pattern (NaN payloads aside)."""
    array = values.numpy().astype(np.float32)
    bits = array.view(np.uint32).copy()
    bits[np.isnan(array)] = 0x7FC00000
    return bits


def _f32(value: float) -> np.float32:
    """A Python float rounded once to float32 (overflow to +-Inf, as IEEE rounding does)."""
    with np.errstate(over="ignore"):
        return np.float32(value)


def test_every_e2m1_code_is_its_definition() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    expected = torch.tensor([_e2m1_definition(c) for c in range(16)], dtype=torch.float32)
    assert (_bits(fp4.e2m1_to_float(codes)) == _bits(expected)).all()  # -0.0 for code 8
    assert fp4.E2M1_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def test_every_e8m0_scale_including_its_extremes() -> None:
    values = fp4.e8m0_to_float(torch.arange(256, dtype=torch.uint8))
    for s in range(255):
        assert values[s].item() == math.ldexp(1.0, s - 127), s
    assert values[0].item() == 2.0**-127 and values[0].item() > 0  # a subnormal, not zero
    assert values[254].item() == 2.0**127
    assert math.isnan(values[255].item())


def test_every_e4m3_byte_is_its_definition_and_torchs() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    expected = torch.tensor([_e4m3_definition(b) for b in range(256)], dtype=torch.float32)
    assert (_bits(fp4.e4m3_to_float(codes)) == _bits(expected)).all()
    assert (_bits(fp4.e4m3_to_float(codes)) == _bits(codes.view(torch.float8_e4m3fn).float())).all()


def _every_code_row(num_rows: int) -> torch.Tensor:
    """[num_rows, 16] bytes: each row's 32 codes are 0..15 twice (low nibble first)."""
    codes = torch.arange(32, dtype=torch.uint8) % 16
    return fp4.pack_fp4(codes).repeat(num_rows, 1)


def test_mxfp4_dequantizes_every_code_at_every_scale_exactly() -> None:
    qweight = _every_code_row(256)  # row s: scale byte s
    scales = torch.arange(256, dtype=torch.uint8).unsqueeze(1)
    got = fp4.dequantize_mxfp4(qweight, scales)
    expected = np.empty((256, 32), dtype=np.float32)
    for s in range(256):
        for k in range(32):
            value = _e2m1_definition(k % 16)
            expected[s, k] = math.nan if s == 0xFF else _f32(value * 2.0 ** (s - 127))
    assert (_bits(got) == _bits(torch.from_numpy(expected))).all()
    assert torch.isinf(got[254, 6]) and got[254, 5] == 3 * 2.0**127  # 4 * 2^127 overflows
    assert torch.isnan(got[255]).all()  # a NaN scale makes the whole block NaN (sec. 6.3)


@pytest.mark.parametrize("divide", [False, True], ids=["modelopt-multiply", "ct-divide"])
@pytest.mark.parametrize("tensor_scale", [1.0, 3.0517578125e-05, 0.1234567, 7.0e-3])
def test_nvfp4_dequantizes_every_code_at_every_scale_exactly(
    tensor_scale: float, divide: bool
) -> None:
    qweight = _every_code_row(256)[:, :8]  # 16 codes per row: one block
    scales = torch.arange(256, dtype=torch.uint8).unsqueeze(1)
    t = torch.tensor([tensor_scale], dtype=torch.float32)
    got = fp4.dequantize_nvfp4(qweight, scales, t, divide=divide)
    t32 = np.float32(tensor_scale)
    expected = np.empty((256, 16), dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for s in range(256):
            block = np.float32(_e4m3_definition(s))
            scale = block / t32 if divide else block * t32  # rounded to float32 once
            for k in range(16):
                expected[s, k] = np.float32(_e2m1_definition(k)) * scale
    assert (_bits(got) == _bits(torch.from_numpy(expected))).all()


def test_nvfp4_keeps_a_tensor_scale_per_row() -> None:
    qweight, scales = _every_code_row(2)[:, :8], torch.tensor([[0x38], [0x38]], dtype=torch.uint8)
    got = fp4.dequantize_nvfp4(qweight, scales, torch.tensor([1.0, 0.5]))
    assert torch.equal(got[1], got[0] * 0.5)


def test_e2m1_rounding_ties_to_even_and_saturates() -> None:
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 100.0, -0.25, -0.3, -7.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 0.0, -0.5, -6.0]
    assert fp4.e2m1_to_float(fp4.quantize_e2m1(x)).tolist() == want
    values = torch.tensor(fp4.E2M1_VALUES)
    assert torch.equal(fp4.e2m1_to_float(fp4.quantize_e2m1(values)), values)


def test_mxfp4_round_trip_is_exact_on_its_grid_and_within_a_step_elsewhere() -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (8, 64), generator=gen, dtype=torch.uint8)
    codes[:, 0] = 7  # every block holds a 6 (so the spec's exponent is the grid's)
    codes[:, 32] = 15
    scales = torch.randint(100, 140, (8, 2), generator=gen, dtype=torch.uint8)
    grid = fp4.dequantize_mxfp4(fp4.pack_fp4(codes), scales)
    qweight, got_scales = fp4.quantize_mxfp4(grid)
    assert torch.equal(fp4.dequantize_mxfp4(qweight, got_scales), grid)

    weight = torch.randn(16, 256, generator=gen)
    restored = fp4.dequantize_mxfp4(*fp4.quantize_mxfp4(weight))
    step = fp4.expand(fp4.e8m0_to_float(fp4.quantize_mxfp4(weight)[1]), 32)  # = one code step
    # Half the grid's widest gap (4 to 6: two steps), also for a block maximum below 7 steps
    # that saturates at 6.
    assert ((restored - weight).abs() <= step).all()


def test_nvfp4_round_trip_is_close_and_zero_blocks_stay_zero() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(16, 64, generator=gen)
    weight[3, :16] = 0.0
    qweight, scales, t = fp4.quantize_nvfp4(weight)
    assert t.item() == pytest.approx(weight.abs().max().item() / (6 * 448))
    restored = fp4.dequantize_nvfp4(qweight, scales, t)
    assert torch.equal(restored[3, :16], torch.zeros(16))
    block_scale = fp4.expand(fp4.e4m3_to_float(scales) * t, 16)
    assert ((restored - weight).abs() <= block_scale * 1.0 + 1e-6).all()
    rel = (restored - weight).norm() / weight.norm()
    assert rel < 0.12
