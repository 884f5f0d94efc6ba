"""INT4 weights: packing, round-to-nearest and GPTQ, and torch's CPU int4 matmul against the
slow float reference."""

from __future__ import annotations

import pytest
import torch

from densa.formats.int4 import dequantize_int4, pack_nibbles, unpack_nibbles
from densa.kernels.cpu.int4_linear import (
    cpu_group_size,
    cpu_int4_linear,
    int4_linear_ref,
    pack_for_cpu,
)
from densa.quant import int4
from densa.quant.weight_format import WeightFormat


def _weights(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))


def _fmt(group_size: int = 32, symmetric: bool = True, **kw: object) -> WeightFormat:
    return WeightFormat("int4", group_size=group_size, symmetric=symmetric, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("in_features", [1, 2, 7, 64])
def test_nibbles_round_trip(in_features: int) -> None:
    codes = torch.randint(0, 16, (5, in_features), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (5, (in_features + 1) // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed, in_features), codes)
    assert torch.equal(packed[0, 0] & 0xF, codes[0, 0])  # even column in the low nibble


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(
    ("group_size", "in_features"), [(32, 64), (64, 96), (128, 576), (128, 100)]
)
def test_rtn_error_is_at_most_half_a_step(
    symmetric: bool, group_size: int, in_features: int
) -> None:
    weight = _weights(24, in_features)
    fmt = _fmt(group_size, symmetric, scale_dtype="float16")
    parts = int4.quantize_rtn(weight, fmt)
    assert ("zeros" in parts) == (not symmetric)
    assert parts["scales"].shape == (24, -(-in_features // group_size))
    restored = int4.dequantize(parts, fmt, in_features)
    step = parts["scales"].float().repeat_interleave(group_size, 1)[:, :in_features]
    # Half a step of rounding, plus the scale's own fp16 rounding over at most 8 steps.
    assert torch.all((restored - weight).abs() <= step * (0.5 + 8 * 2**-10) + 1e-6)


def test_asymmetric_g32_reproduces_a_q4_1_grid() -> None:
    """Weights already on llama.cpp's Q4_1 grid (w = d*q + m per 32 columns) come back almost
    exactly: this is why int4 asym g32 flatters results on the bundled Q4_1 model."""
    gen = torch.Generator().manual_seed(1)
    d = torch.rand(16, 4, 1, generator=gen) * 0.05 + 0.01
    m = -torch.rand(16, 4, 1, generator=gen)
    q = torch.randint(0, 16, (16, 4, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # each group spans its full grid, as Q4_1 blocks typically do
    weight = (d * q + m).reshape(16, 128)
    fmt = _fmt(32, symmetric=False, scale_dtype="float16")
    restored = int4.dequantize(int4.quantize_rtn(weight, fmt), fmt, 128)
    assert (restored - weight).abs().max() < 2e-3 * weight.abs().max()
    other = _fmt(128, symmetric=True, scale_dtype="float16")
    off_grid = int4.dequantize(int4.quantize_rtn(weight, other), other, 128)
    assert (off_grid - weight).abs().max() > 10 * (restored - weight).abs().max()


def test_gptq_beats_rtn_on_the_layer_output() -> None:
    """GPTQ minimizes ||X W^T - X Q^T|| for the calibration inputs; with correlated inputs it
    must beat round-to-nearest clearly on held-out inputs from the same distribution."""
    gen = torch.Generator().manual_seed(0)
    mixing = torch.randn(96, 96, generator=gen) * torch.linspace(0.05, 2.0, 96)
    calib, held_out = (torch.randn(n, 96, generator=gen) @ mixing for n in (2048, 512))
    weight = _weights(64, 96, seed=3)
    hessian = 2 * calib.double().T @ calib.double() / len(calib)
    errors = {}
    for method in ("rtn", "gptq"):
        fmt = _fmt(32, symmetric=True, method=method)
        parts = (
            int4.quantize_gptq(weight, hessian, fmt)
            if method == "gptq"
            else int4.quantize_rtn(weight, fmt)
        )
        restored = int4.dequantize(parts, fmt, 96)
        errors[method] = ((held_out @ (weight - restored).T) ** 2).mean().item()
    assert errors["gptq"] < 0.85 * errors["rtn"], errors  # measured: 0.73


def test_gptq_column_blocks_are_an_exact_reformulation() -> None:
    """GPTQ's lazy block updates only reorder the arithmetic: quantizing in blocks of 32 columns
    (the error of each block pushed onto every later block at once) gives the codes of one
    96-column block. Dropping the cross-block update changes most codes of the later blocks."""
    gen = torch.Generator().manual_seed(1)
    mixing = torch.randn(96, 96, generator=gen) * torch.linspace(0.05, 2.0, 96)
    calib = torch.randn(1024, 96, generator=gen) @ mixing
    weight = _weights(64, 96, seed=4)
    hessian = 2 * calib.double().T @ calib.double() / len(calib)
    fmt = _fmt(32, symmetric=True, method="gptq")
    whole = int4.quantize_gptq(weight, hessian, fmt, block_size=96)
    blocked = int4.quantize_gptq(weight, hessian, fmt, block_size=32)
    same = (unpack_nibbles(whole["qweight"], 96) == unpack_nibbles(blocked["qweight"], 96)).float()
    assert same.mean() > 0.995, same.mean()
    torch.testing.assert_close(whole["scales"], blocked["scales"], rtol=1e-2, atol=0)


def test_gptq_layout_matches_rtn_and_keeps_dead_inputs_zero() -> None:
    weight = _weights(16, 70)
    hessian = torch.eye(70, dtype=torch.float64)
    hessian[5, 5] = 0.0  # an input that never fired
    fmt = _fmt(32, symmetric=False, method="gptq")
    parts = int4.quantize_gptq(weight, hessian, fmt)
    reference = int4.quantize_rtn(weight, _fmt(32, symmetric=False))
    assert {k: v.shape for k, v in parts.items()} == {k: v.shape for k, v in reference.items()}
    restored = int4.dequantize(parts, fmt, 70)
    assert restored[:, 5].abs().max() <= parts["scales"][:, 0].float().max() / 2


@pytest.mark.parametrize(
    ("out_features", "in_features", "group_size", "expected"),
    [
        (960, 576, 128, 64),
        (576, 1536, 128, 128),
        (64, 96, 64, 32),
        (50, 128, 32, None),
        (32, 48, 32, None),
    ],
)
def test_cpu_group_size(
    out_features: int, in_features: int, group_size: int, expected: int | None
) -> None:
    assert cpu_group_size(out_features, in_features, group_size) == expected


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(("group_size", "in_features"), [(32, 96), (64, 128), (128, 576)])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_torch_cpu_int4_matmul_matches_the_reference(
    symmetric: bool, group_size: int, in_features: int, rows: int
) -> None:
    weight = _weights(48, in_features)
    parts = int4.quantize_rtn(weight, _fmt(group_size, symmetric))
    zeros = parts.get("zeros")
    pack = pack_for_cpu(parts["qweight"], parts["scales"], zeros, group_size, in_features)
    assert pack is not None
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(48)
    expected = int4_linear_ref(x, parts["qweight"], parts["scales"], zeros, group_size, bias)
    got = cpu_int4_linear(x, pack.packed, pack.scales_and_zeros, pack.group_size, bias)
    # The op takes bf16 activations: compare at bf16 precision of the inputs.
    scale = expected.abs().max()
    torch.testing.assert_close(got, expected, atol=float(scale) * 2e-2, rtol=0)
    x_bf16 = x.bfloat16().float()
    exact = int4_linear_ref(x_bf16, parts["qweight"], parts["scales"], zeros, group_size, bias)
    torch.testing.assert_close(got, exact, atol=float(scale) * 5e-3, rtol=0)


def test_dequantize_matches_the_formula() -> None:
    codes = torch.tensor([[0, 15, 8, 7]], dtype=torch.uint8)
    scales = torch.tensor([[0.5, 2.0]], dtype=torch.bfloat16)
    zeros = torch.tensor([[1.0, -1.0]], dtype=torch.bfloat16)
    weight = dequantize_int4(pack_nibbles(codes), scales, zeros, 2, 4)
    assert weight.tolist() == [[-3.0, 4.5, -1.0, -3.0]]
