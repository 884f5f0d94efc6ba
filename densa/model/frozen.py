"""Empty, non-trainable parameters: the quantized layers' tensors, filled by the loader (or left
empty once their data moved into a kernel's packed buffers)."""

from __future__ import annotations

import torch
from torch import nn


def frozen_parameter(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
