"""Building blocks shared by model families: RMSNorm, rotary embeddings, the gated MLP."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from densa.model.linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op instead of seven small ones per call
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalize in fp32 whatever the compute dtype, as the reference implementation does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): folds the residual add into the norm."""
        residual = x + residual
        return self.forward(residual), residual


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the Hugging Face Llama layout), cos/sin precomputed for every position."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        arange = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device)
        inv_freq = 1.0 / (theta ** (arange / head_dim))
        inv_freq = _scale_inv_freq(inv_freq, scaling, head_dim, theta)
        positions = torch.arange(max_position, dtype=torch.float64, device=device)
        freqs = torch.outer(positions, inv_freq)  # [max_position, head_dim / 2]
        factor = _attention_factor(scaling)  # YaRN scales cos and sin; 1 otherwise
        self.inv_freq, self.factor = inv_freq, factor  # float64 [head_dim / 2], float
        # [max_position, head_dim] with the half repeated, matching rotate_half below. Plain
        # attributes, not buffers: the model is built on the meta device and materialized empty,
        # which would wipe buffers; these are computed, never loaded.
        self.cos = (torch.cat([freqs.cos(), freqs.cos()], -1) * factor).float()
        self.sin = (torch.cat([freqs.sin(), freqs.sin()], -1) * factor).float()

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a step's positions ([T] -> [T, 1, D] each); shared by every layer."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return cos, sin

    def mean_rotation(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean of cos and of sin over positions [0, num_positions) ([D] each, float64),
        whatever the table's length: rotating x by them gives the mean of x's rotations."""
        positions = torch.arange(num_positions, dtype=torch.float64, device=self.inv_freq.device)
        freqs = torch.outer(positions, self.inv_freq)
        cos, sin = freqs.cos().mean(0) * self.factor, freqs.sin().mean(0) * self.factor
        return torch.cat([cos, cos]), torch.cat([sin, sin])

    @staticmethod
    def rotate_heads(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, heads, D] (any number of q and k heads) -> rotated, same shape."""
        cos, sin = cos_sin
        return x * cos + _rotate_half(x) * sin

    @staticmethod
    def rotate_interleaved(
        x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """RoPE over adjacent pairs (x0, x1), (x2, x3) ... (DeepSeek's layout), written out
        de-interleaved: [rotated evens | rotated odds]. x: [T, heads, D] -> same shape. Dot
        products are unchanged by the reordering, as long as q and k both get it."""
        cos, sin = cos_sin
        half = x.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]  # the table repeats each angle in halves
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _scale_inv_freq(
    inv_freq: torch.Tensor, scaling: dict[str, Any] | None, head_dim: int, theta: float
) -> torch.Tensor:
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, scaling, head_dim, theta)
    raise NotImplementedError(
        f"rope scaling type {kind!r} is not supported (supported: linear, llama3, yarn)"
    )


def _yarn_inv_freq(
    inv_freq: torch.Tensor, scaling: dict[str, Any], head_dim: int, theta: float
) -> torch.Tensor:
    # YaRN (Peng et al. 2023): dimensions that rotate fewer than beta_slow times over the
    # original context are interpolated (slowed by `factor`), those rotating more than beta_fast
    # times are kept, with a linear ramp between.
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.arange(head_dim // 2, dtype=inv_freq.dtype, device=inv_freq.device)
    ramp = ((ramp - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _attention_factor(scaling: dict[str, Any] | None) -> float:
    """How much YaRN scales cos and sin (so q.k by its square); 1 for other RoPE types."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low_freq_factor, old_len / high_freq_factor
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    middle = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(middle, blended, out)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# The gated MLP's activation by its config.json name: SwiGLU (silu) or GeGLU (gelu, tanh form).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": _gelu_tanh,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise NotImplementedError(
            f"MLP activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
        )
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each [T, intermediate]
        return self.down_proj(self.act(gate) * up)
