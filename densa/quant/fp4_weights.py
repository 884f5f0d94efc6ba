"""MXFP4 and NVFP4 weights in densa checkpoints (`densa quantize --weights mxfp4|nvfp4`): the parts
stored per [out, in] weight, the runtime parts the layers take, and the dequantization (the
layout and formulas: densa.formats.fp4).

    stored parts       mxfp4                         nvfp4
    qweight            [N, K/2] uint8 e2m1 codes     the same
    scales             [N, K/32] uint8 E8M0          [N, K/16] uint8 e4m3 bits
    tensor_scale       -                             [1] float32 (the tensor's; ModelOpt's
                                                     weight_scale_2)

Runtime parts are the same, except NVFP4's tensor scale, repeated per row ([N]) so a fused
q|k|v of three tensors keeps three. Stacked experts add a leading expert dimension to every
part (each expert its own tensor scale).
"""

from __future__ import annotations

import torch

from densa.formats import fp4

Parts = dict[str, torch.Tensor]


def quantize(weight: torch.Tensor, kind: str) -> Parts:
    """[N, K] float -> stored parts, by round-to-nearest (K must be a multiple of the group)."""
    group = fp4.groups_of(kind)
    if weight.shape[-1] % group:
        raise ValueError(
            f"{kind} needs in_features divisible by {group}; this weight has {weight.shape[-1]}"
        )
    if kind == "mxfp4":
        qweight, scales = fp4.quantize_mxfp4(weight)
        return {"qweight": qweight, "scales": scales}
    qweight, scales, t = fp4.quantize_nvfp4(weight)
    return {"qweight": qweight, "scales": scales, "tensor_scale": t.reshape(1)}


def to_runtime(parts: Parts, kind: str) -> Parts:
    """Stored parts (2-D or stacked) -> the layers' parts: NVFP4's tensor scale per row."""
    runtime = {"qweight": parts["qweight"], "scales": parts["scales"].view(torch.uint8)}
    if kind == "nvfp4":
        rows = parts["qweight"].shape[:-1]  # [N] or [E, N]
        scale = parts["tensor_scale"].float()
        runtime["tensor_scale"] = scale.reshape(*rows[:-1], -1).expand(rows).contiguous()
    return runtime


def dequantize(parts: Parts, kind: str) -> torch.Tensor:
    """Stored or runtime parts -> [N, K] (or [E, N, K]) float32."""
    scales = parts["scales"].view(torch.uint8)
    if kind == "mxfp4":
        return fp4.dequantize_mxfp4(parts["qweight"], scales)
    runtime = to_runtime(parts, kind)
    return fp4.dequantize_nvfp4(runtime["qweight"], scales, runtime["tensor_scale"])
