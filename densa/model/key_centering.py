"""Centered keys: each layer stores K minus a constant vector, so quantized pages keep precision.

Qwen2-family checkpoints put huge biases on a few k_proj channels (the 1.5B's layer 0: up to
|354| where the median channel is 0.6), all on the slowest-rotating RoPE pairs, so after RoPE
those channels of K are nearly the same constant at every position. A quantized page spends its
range on them: an e4m3 step at 354 is 32, and q is large on exactly those channels, so the
rounding error of one channel moves the logit by tens. GSM8K on the 1.5B fell from 38% (BF16
pages) to 3% (FP8 pages) before this.

Subtracting any constant vector c from every key of a layer's kv head changes no attention
output: q.(k - c) = q.k - q.c, the same shift for every key a query sees, and softmax ignores a
common shift. So K is stored centered and nothing is added back on the read side; only the
precision changes. c is the mean of RoPE(bias, p) over the first KEY_CENTER_POSITIONS
positions: the constant nearest (in mean square) to what the bias becomes after rotation. On
slow pairs it is the bias itself; on fast pairs the rotations average out and c is ~0, so a
fast pair is never made worse than uncentered.

c depends only on the k bias and the RoPE frequencies, never on the configuration (not on
--max-model-len), so every engine that loads the same weights stores the same K: prefill and
decode pools, tiers and prefix caches agree. Pages of an engine that centers are not
interchangeable with those of one that does not: `key_encoding` names the choice for the KV
fingerprints.

Not for attention that is not shift-invariant (logit soft-capping, sink logits): only the plain
Llama-family attention, and only where k_proj has a bias (without one the keys carry no
constant to remove).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from densa.model.layers import RotaryEmbedding

# Positions the center averages the rotated bias over. A property of the KV encoding: changing
# it changes the stored K, so it is part of `key_encoding`'s name.
KEY_CENTER_POSITIONS = 4096
CENTERED = f"keys-centered-{KEY_CENTER_POSITIONS}"
RAW = "keys-raw"


def key_center(rotary: RotaryEmbedding, k_bias: torch.Tensor) -> torch.Tensor:
    """[kv heads, head dim] k bias -> the constant to subtract from every rotated key, same shape
    (float32, computed in float64)."""
    cos_mean, sin_mean = rotary.mean_rotation(KEY_CENTER_POSITIONS)  # [D] each, float64
    bias = k_bias.detach().to(device=cos_mean.device, dtype=torch.float64)
    return RotaryEmbedding.rotate_heads(bias, (cos_mean, sin_mean)).float()


def center_keys(model: Any, enabled: bool = True) -> int:
    """Give every biased Llama-family attention layer of `model` its key center (`k_center`, on
    the bias's device), or take them away (`enabled=False`: keys stored as computed, as before
    centering existed; for comparisons). Returns how many layers it changed. Call it before the
    model stores any page: pages written either way cannot be mixed."""
    rotary = getattr(model, "rotary", None)
    if rotary is None:
        return 0
    count = 0
    for attn in _biased_attention(model):
        k_bias = _k_bias(attn)
        attn.k_center = key_center(rotary, k_bias).to(k_bias.device) if enabled else None
        count += 1
    switch = getattr(model, "fused_decode", None)
    if switch is not None:
        switch.reset()  # the C++ decoder copied the old centers
    return count


def key_encoding(model: Any) -> str:
    """How this model's pages hold K, for the fingerprints that say which pages are whose."""
    layers = getattr(model, "layers", ())
    centered = any(getattr(layer_attention(x), "k_center", None) is not None for x in layers)
    return CENTERED if centered else RAW


def layer_attention(layer: Any) -> Any:
    return getattr(layer, "self_attn", None)


def _biased_attention(model: Any) -> Iterator[Any]:
    """The layers' attention modules that can center (Llama-family) and have a qkv bias."""
    for layer in getattr(model, "layers", ()):
        attn = layer_attention(layer)
        if hasattr(attn, "k_center") and getattr(attn.qkv_proj, "bias", None) is not None:
            yield attn


def _k_bias(attn: Any) -> torch.Tensor:
    """The k part of the fused qkv bias, as [kv heads, head dim]."""
    k_bias = attn.qkv_proj.bias.detach()[attn.q_size : attn.q_size + attn.kv_size]
    return k_bias.view(attn.num_kv_heads, attn.head_dim)
