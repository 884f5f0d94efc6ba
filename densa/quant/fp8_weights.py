"""FP8 (e4m3) weights with one float32 scale per B x B block, as FP8 checkpoints of large models
store them: real w = fp8 * scale[n // B, k // B], scale = block max|w| / 448 (e4m3's largest)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from densa.formats.fp8_blocks import dequantize_fp8, expand_block_scales
from densa.formats.fp8_kv import FP8_MAX


def quantize_blocks(weight: torch.Tensor, block: int) -> dict[str, torch.Tensor]:
    """[N, K] float -> stored parts {weight: fp8 [N, K], scale: fp32 [ceil(N/B), ceil(K/B)]}."""
    out_features, in_features = weight.shape
    row_blocks, col_blocks = -(-out_features // block), -(-in_features // block)
    # Zero padding never raises a block's max|w|, so partial edge blocks need no special case.
    padded = F.pad(
        weight.float(), (0, col_blocks * block - in_features, 0, row_blocks * block - out_features)
    )
    blocks = padded.view(row_blocks, block, col_blocks, block)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # [row_blocks, col_blocks]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = (blocks / scale[:, None, :, None]).view_as(padded)[:out_features, :in_features]
    return {"weight": scaled.to(torch.float8_e4m3fn).contiguous(), "scale": scale}


def to_runtime(parts: dict[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """Stored parts -> runtime parts: block scales repeated per row ({weight, weight_scale})."""
    weight = parts["weight"]
    return {
        "weight": weight,
        "weight_scale": expand_block_scales(parts["scale"].float(), weight.shape[0], block),
    }


def dequantize(parts: dict[str, torch.Tensor], block: int) -> torch.Tensor:
    """Stored parts -> [N, K] float32."""
    runtime = to_runtime(parts, block)
    return dequantize_fp8(runtime["weight"], runtime["weight_scale"], block)
