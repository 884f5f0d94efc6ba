"""FP8 (e4m3) weights with block scales: quantization, the runtime layout and the CPU kernels
against the slow reference (plain fp8 cast, then float32 matmul)."""

from __future__ import annotations

import pytest
import torch

from densa.formats.fp8_blocks import dequantize_fp8, expand_block_scales
from densa.formats.fp8_kv import FP8_MAX
from densa.kernels.cpu.fp8_linear import MAX_STREAMING_ROWS, fp8_linear, fp8_linear_ref
from densa.quant import fp8_weights


def _weights(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("shape", "block"), [((256, 256), 128), ((200, 300), 128), ((17, 5), 4)])
def test_block_quantization(shape: tuple[int, int], block: int) -> None:
    weight = _weights(*shape)
    weight[0, 0] = 50.0  # one outlier must only coarsen its own block
    parts = fp8_weights.quantize_blocks(weight, block)
    row_blocks, col_blocks = -(-shape[0] // block), -(-shape[1] // block)
    assert parts["weight"].dtype == torch.float8_e4m3fn and parts["weight"].shape == shape
    assert parts["scale"].shape == (row_blocks, col_blocks)
    assert parts["weight"].float().abs().max() <= FP8_MAX
    restored = fp8_weights.dequantize(parts, block)
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 for normal values.
    outside = torch.ones_like(weight, dtype=torch.bool)
    outside[:block, :block] = False
    rel = (restored - weight).abs() / weight.abs().clamp_min(1e-2)
    assert rel[outside].max() <= 2**-4 + 1e-3
    assert (restored - weight)[outside].abs().max() < 0.2


def test_runtime_scales_are_block_scales_per_row() -> None:
    block_scales = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    rows = expand_block_scales(block_scales, out_features=5, block=3)
    assert rows.tolist() == [[1.0, 2.0]] * 3 + [[3.0, 4.0]] * 2


@pytest.mark.parametrize("rows", [1, 3, MAX_STREAMING_ROWS, MAX_STREAMING_ROWS + 1, 40])
@pytest.mark.parametrize(("shape", "block"), [((96, 576), 128), ((33, 70), 16)])
def test_fp8_linear_matches_the_reference(rows: int, shape: tuple[int, int], block: int) -> None:
    parts = fp8_weights.to_runtime(fp8_weights.quantize_blocks(_weights(*shape), block), block)
    weight, scale = parts["weight"], parts["weight_scale"]
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(shape[0])
    expected = fp8_linear_ref(x, weight, scale, block, bias)
    torch.testing.assert_close(
        fp8_linear(x, weight, scale, block, bias), expected, atol=1e-3, rtol=1e-4
    )


def test_dequantize_is_exact_for_every_code() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[~torch.isnan(codes.float())].reshape(1, -1)
    scale = torch.full((1, 1), 0.5)
    expected = codes.float() * 0.5
    assert torch.equal(dequantize_fp8(codes, scale, block=codes.shape[1]), expected)
    x = torch.eye(codes.shape[1])[:1]  # picks column 0 through the streaming kernel
    assert fp8_linear(x, codes.reshape(-1, 1)[:4].contiguous(), torch.ones(4, 1), 1).shape == (1, 4)
