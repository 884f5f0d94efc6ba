"""INT4 weights (w4a16): the storage layout and its formulas, shared by the kernels that read it
(densa/kernels/cpu/int4_linear.py, densa/kernels/triton/int4_linear.py) and the quantizers that
write it (densa/quant/int4.py, densa/quant/shipped_layouts.py).

Storage (row-major, so the rows of fused projections concatenate like dense rows):

    qweight [N, ceil(K/2)] uint8   two 4-bit codes per byte: column 2j in the low nibble, 2j+1 high
    scales  [N, G] bf16/fp16       one per group of `group_size` input columns, G = ceil(K / g)
    zeros   [N, G] or None         asymmetric offset; symmetric formats have none

    w[n, k] = (q[n, k] - 8) * scales[n, k // g] + zeros[n, k // g]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CODE_OFFSET = 8  # stored codes 0..15 stand for -8..7


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes in 0..15 -> [N, ceil(K/2)] uint8, even columns in the low nibble."""
    if codes.shape[1] % 2:
        codes = F.pad(codes, (0, 1))
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """[N, ceil(K/2)] uint8 -> [N, K] uint8 codes."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)[:, :in_features]


def expand_groups(values: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """[N, G] per-group values -> [N, K], each repeated over its group's columns."""
    return values.repeat_interleave(group_size, dim=1)[:, :in_features]


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """The reference dequantization: [N, K] float32 weights."""
    codes = unpack_nibbles(qweight, in_features).float() - CODE_OFFSET
    weight = codes * expand_groups(scales.float(), group_size, in_features)
    if zeros is not None:
        weight += expand_groups(zeros.float(), group_size, in_features)
    return weight
