"""Gemma 3 (text): local sliding-window layers interleaved with global ones, written for paged KV.

What sets it apart from Llama (Gemma Team, "Gemma 3 Technical Report", 2025):
- RMSNorm scales by (1 + w), computed in float32 (weights are stored centred on 0);
- "sandwich" norms: each sub-block's output is normalized before it joins the residual stream,
      h = x + norm_post_attn(attn(norm_in(x)));   out = h + norm_post_ffw(mlp(norm_pre_ffw(h)));
- q and k heads are RMS-normalized (QK-norm, replacing Gemma 2's logit soft-capping);
- five local layers (window of 512 tokens in the 270M model; RoPE base 10k) per global layer
  (RoPE base 1M), by the config's `layer_types`;
- GeGLU MLP (tanh-approximated GELU), embeddings scaled by sqrt(hidden_size), tied output head;
- softmax scale query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from densa.model.arch import ArchConfig
from densa.model.attention import AttentionBackend, AttentionMetadata, LayerKVCache
from densa.model.interface import CausalLM
from densa.model.layers import GatedMLP, RotaryEmbedding
from densa.model.linear import Linear
from densa.model.local_attention import paged_attention_in_window
from densa.model.weight_loading import GATE_UP_FUSED, QKV_FUSED, FusedWeightLoader

CosSin = tuple[torch.Tensor, torch.Tensor]
LOCAL_ROPE_THETA = 10_000.0  # Gemma 3's local layers, when the config does not say


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), in float32 whatever the compute dtype, cast back at the end."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim, self.q_size, self.kv_size = cfg.head_dim, cfg.q_size, cfg.kv_size
        self.scale = cfg.query_scale or cfg.head_dim**-0.5
        self.window = cfg.window_of(layer_idx)  # None: a global layer
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))  # [T, H, D]
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))  # [T, KVH, D]
        q, k = RotaryEmbedding.rotate_heads(q, rope), RotaryEmbedding.rotate_heads(k, rope)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention_in_window(backend, q, k, v, cache, meta, self.scale, self.window)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.is_local = cfg.window_of(layer_idx) is not None
        self.self_attn = Gemma3Attention(cfg, layer_idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        attn = self.self_attn(rope, self.input_layernorm(hidden), cache, meta, backend)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, cfg: ArchConfig, max_position: int, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size**0.5
        self.rotary_global = RotaryEmbedding(
            cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, device=device
        )
        local_theta = cfg.local_rope_theta or LOCAL_ROPE_THETA
        self.rotary_local = RotaryEmbedding(cfg.head_dim, max_position, local_theta, device=device)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.loader = FusedWeightLoader(
            QKV_FUSED | GATE_UP_FUSED, (cfg.q_size, cfg.kv_size, cfg.kv_size),
            tied_head=cfg.tie_word_embeddings,
        )  # fmt: skip

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = cast(nn.Parameter, self.embed_tokens.weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKVCache],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        embeds = self.embed_tokens(input_ids)
        # The scale is rounded to the compute dtype first, as in the reference implementation.
        hidden = embeds * torch.tensor(self.embed_scale, dtype=embeds.dtype)
        global_rope = self.rotary_global.lookup(positions, hidden.dtype)
        local_rope = self.rotary_local.lookup(positions, hidden.dtype)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            rope = local_rope if layer.is_local else global_rope
            hidden = layer(rope, hidden, cache, meta, backend)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.loader.load(self, weights)

    def checkpoint_target(self, hf_name: str) -> str:
        return self.loader.target(hf_name)
