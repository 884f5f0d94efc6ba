"""FP8 (e4m3) weights with block scales: the runtime layout and its formulas, shared by the
kernels that read it (densa/kernels/cpu/fp8_linear.py, densa/kernels/triton/fp8_linear.py) and
the quantizers that write it (densa/quant/fp8_weights.py, densa/quant/shipped_layouts.py).

Runtime layout (row-major, so fused projections concatenate like dense rows):

    weight [N, K] float8_e4m3fn
    scale  [N, ceil(K / B)] float32    real w[n, k] = weight[n, k] * scale[n, k // B]

Checkpoints store one scale per B x B block (as FP8 releases of large models do); the loader
repeats each block scale over the block's rows (`expand_block_scales`), 4 bytes per B weights.
"""

from __future__ import annotations

import torch


def expand_block_scales(block_scales: torch.Tensor, out_features: int, block: int) -> torch.Tensor:
    """[ceil(N/B), ceil(K/B)] block scales -> [N, ceil(K/B)] row scales."""
    return block_scales.repeat_interleave(block, dim=0)[:out_features].contiguous()


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """[N, K] fp8 with [N, ceil(K/B)] row scales -> [N, K] float32."""
    dense = weight.float()  # measured faster here than widening by bit moves in eager torch
    out_features, in_features = dense.shape
    num_blocks = scale.shape[1]
    if num_blocks * block == in_features:  # whole blocks: scale through a view, no expansion
        blocks = dense.view(out_features, num_blocks, block) * scale.float()[:, :, None]
        return blocks.view(out_features, in_features)
    return dense * scale.float().repeat_interleave(block, dim=1)[:, :in_features]
