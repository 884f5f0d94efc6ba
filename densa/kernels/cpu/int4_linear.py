"""INT4 weight-only linear layers (w4a16): a torch reference and the CPU path, over the storage
layout of densa.formats.int4 (w[n, k] = (q[n, k] - 8) * scales[n, k // g] + zeros[n, k // g]).

That is also the arithmetic of torch's CPU int4 matmul (`_weight_int4pack_mm_for_cpu`, bf16
activations), so its packed layout is built once at load time. That op wants N % 16 == 0, group
size 32/64/128/256 and K divisible by the group. A stored group of 128 over K = 576 (SmolLM2's
hidden size; 4.5 groups) is re-expressed exactly as groups of 64 by repeating each scale; shapes
that fit no group fall back to dequantize-then-matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from densa.formats.int4 import dequantize_int4, unpack_nibbles

TORCH_GROUP_SIZES = (128, 64, 32)  # what the CPU op accepts (256 too; never a stored size here)
TORCH_N_MULTIPLE = 16


def int4_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slow, obviously correct: dequantize to float32, multiply. [M, K] -> [M, N], x's dtype."""
    weight = dequantize_int4(qweight, scales, zeros, group_size, x.shape[-1])
    out = F.linear(x.float(), weight, None if bias is None else bias.float())
    return out.to(x.dtype)


# ---- torch's CPU int4 matmul -------------------------------------------------------------------
@dataclass
class CpuInt4Pack:
    """A weight in the layout of torch's CPU int4 matmul."""

    packed: torch.Tensor  # opaque uint8 layout from _convert_weight_to_int4pack_for_cpu
    scales_and_zeros: torch.Tensor  # [K / group, N, 2] bf16
    group_size: int  # the op's group size: divides the stored one and K


def cpu_group_size(out_features: int, in_features: int, group_size: int) -> int | None:
    """The largest group torch's op accepts that tiles both K and the stored groups, or None."""
    if out_features % TORCH_N_MULTIPLE:
        return None
    for size in TORCH_GROUP_SIZES:
        if size <= group_size and group_size % size == 0 and in_features % size == 0:
            return size
    return None


def pack_for_cpu(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    in_features: int,
) -> CpuInt4Pack | None:
    """torch's packed layout for this weight, or None when its shape constraints are not met
    or its scales / zeros are not exactly bf16 values (the op's dtype): a checkpoint's fp16 or
    float32 scales (AWQ, GPTQ, asymmetric zero points) then run dequantize-then-matmul, exact."""
    if not (_is_bf16_exact(scales) and _is_bf16_exact(zeros)):
        return None
    out_features = qweight.shape[0]
    op_group = cpu_group_size(out_features, in_features, group_size)
    if op_group is None:
        return None
    codes = unpack_nibbles(qweight, in_features).to(torch.int32)  # [N, K]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    repeat = group_size // op_group
    num_groups = in_features // op_group
    op_scales = scales.repeat_interleave(repeat, dim=1)[:, :num_groups]  # [N, K / op_group]
    op_zeros = (
        torch.zeros_like(op_scales)
        if zeros is None
        else zeros.repeat_interleave(repeat, dim=1)[:, :num_groups]
    )
    scales_and_zeros = torch.stack([op_scales, op_zeros], dim=-1).transpose(0, 1)
    return CpuInt4Pack(packed, scales_and_zeros.to(torch.bfloat16).contiguous(), op_group)


def _is_bf16_exact(values: torch.Tensor | None) -> bool:
    if values is None or values.dtype == torch.bfloat16:
        return True
    return bool(torch.equal(values.to(torch.bfloat16).to(values.dtype), values))


def cpu_int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[M, K] -> [M, N] in x's dtype through a `CpuInt4Pack`'s tensors; activations pass
    through bf16 (the op's input dtype)."""
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), packed, group_size, scales_and_zeros
    ).to(x.dtype)
    return out if bias is None else out + bias
