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

from densa.formats.fp4 import Fp4Scheme

Parts = dict[str, torch.Tensor]


def quantize(weight: torch.Tensor, scheme: Fp4Scheme) -> Parts:
    """[N, K] float -> stored parts, by round-to-nearest (K must be a multiple of the group)."""
    if weight.shape[-1] % scheme.group:
        raise ValueError(
            f"{scheme.name} needs in_features divisible by {scheme.group}; this weight has "
            f"{weight.shape[-1]}"
        )
    qweight, scales, t = scheme.quantize(weight)
    parts = {"qweight": qweight, "scales": scales}
    if t is not None:
        parts["tensor_scale"] = t.reshape(1)
    return parts


def to_runtime(parts: Parts, scheme: Fp4Scheme) -> Parts:
    """Stored parts (2-D or stacked) -> the layers' parts: NVFP4's tensor scale per row."""
    runtime = {"qweight": parts["qweight"], "scales": parts["scales"].view(torch.uint8)}
    if scheme.has_tensor_scale:
        rows = parts["qweight"].shape[:-1]  # [N] or [E, N]
        scale = parts["tensor_scale"].float()
        runtime["tensor_scale"] = scale.reshape(*rows[:-1], -1).expand(rows).contiguous()
    return runtime


def dequantize(parts: Parts, scheme: Fp4Scheme) -> torch.Tensor:
    """Stored or runtime parts -> [N, K] (or [E, N, K]) float32."""
    runtime = to_runtime(parts, scheme)
    return scheme.dequantize(runtime["qweight"], runtime["scales"], runtime.get("tensor_scale"))
