"""Qwen3-Next and Qwen3.5 (`qwen3_next`, `qwen3_5`): Gated DeltaNet beside gated full attention.

    layer_types   linear_attention x3, full_attention, repeated (Qwen3-Next-80B: 48 layers)
    linear        Gated DeltaNet (densa.model.gated_deltanet): a fixed-size state per request
    full          attention over paged K/V, with
                  - an output gate: q_proj gives each head's query and a gate, out * sigmoid(gate)
                  - RMSNorm on each q and k head, RoPE on the first 25% of each head only
    MLP           mixture of experts with a shared expert gated by sigmoid(x g) (as Qwen2-MoE)
    norms         zero-centred: x / rms(x) * (1 + w), in float32

`kv_caches` holds one entry per layer: a LayerKVCache for a full-attention layer, a
LinearStateCache (the layer's state slots) for a linear one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from densa.model.arch import ArchConfig
from densa.model.attention import AttentionBackend, AttentionMetadata, LayerKVCache
from densa.model.family_config import LinearAttentionConfig, MoEConfig
from densa.model.gated_deltanet import (
    GatedDeltaNet,
    LinearStateCache,
    SplitGatedDeltaNet,
    StateBatch,
)
from densa.model.gemma3 import GemmaRMSNorm as ZeroCentredRMSNorm  # the same (1 + w) norm
from densa.model.interface import CausalLM
from densa.model.layers import GatedMLP, RotaryEmbedding
from densa.model.linear import Linear
from densa.model.local_attention import paged_attention_in_window
from densa.model.moe import (
    SparseMoeBlock,
    route_softmax,
    route_softmax_normalized,
    stack_experts,
)
from densa.model.weight_loading import GATE_UP_FUSED, QKV_FUSED, FusedWeightLoader

CosSin = tuple[torch.Tensor, torch.Tensor]
LayerCache = LayerKVCache | LinearStateCache


class GatedAttention(nn.Module):
    """Full attention whose output is gated per head and value by sigmoid(gate)."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
        )  # fmt: skip
        self.q_size, self.kv_size, self.rotary_dim = cfg.q_size, cfg.kv_size, cfg.rotary_dim
        self.scale = cfg.head_dim**-0.5
        # q_proj's rows are per head [query | gate], so the fused weight is 2q + k + v rows
        self.qkv_proj = Linear(cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = ZeroCentredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def rotate(self, x: torch.Tensor, rope: CosSin) -> torch.Tensor:
        """RoPE on each head's first rotary_dim values; the rest pass through."""
        rotated, passed = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat([RotaryEmbedding.rotate_heads(rotated, rope), passed], dim=-1)

    def forward(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qg, k, v = self.qkv_proj(hidden).split(
            [2 * self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        q, gate = qg.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.rotate(self.q_norm(q), rope)  # [T, H, D]
        k = self.rotate(self.k_norm(k.view(num_tokens, self.num_kv_heads, -1)), rope)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention_in_window(backend, q, k, v, cache, meta, self.scale, None)
        out = out * torch.sigmoid(gate)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ArchConfig,
        layer_idx: int,
        linear: LinearAttentionConfig,
        deltanet: type[GatedDeltaNet],
        mlp: nn.Module,  # [T, hidden] -> [T, hidden]: dense or mixture of experts
    ) -> None:
        super().__init__()
        self.is_linear = linear.is_linear_layer(layer_idx)
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.is_linear:
            self.linear_attn = deltanet(cfg.hidden_size, linear, cfg.rms_norm_eps)
        else:
            self.self_attn = GatedAttention(cfg)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        cache: LayerCache,
        step: tuple[AttentionMetadata, AttentionBackend, StateBatch],
    ) -> torch.Tensor:
        meta, backend, states = step
        normed = self.input_layernorm(hidden)
        if self.is_linear:
            mixed = self.linear_attn(normed, cast(LinearStateCache, cache), states)
        else:
            mixed = self.self_attn(rope, normed, cast(LayerKVCache, cache), meta, backend)
        hidden = hidden + mixed
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3NextForCausalLM(CausalLM):
    deltanet: type[GatedDeltaNet] = GatedDeltaNet  # how the family lays out the layer's inputs
    # Qwen3-Next renormalizes the top-k weights when norm_topk_prob says so (it does)
    route = staticmethod(route_softmax)

    def __init__(self, cfg: ArchConfig, max_position: int, device: torch.device) -> None:
        super().__init__()
        if cfg.linear is None:
            raise ValueError(
                f"{cfg.architecture} needs its Gated DeltaNet settings (layer_types with "
                "linear_attention, linear_num_value_heads, ...) in config.json"
            )
        self.cfg = cfg
        self.moe_cfg: MoEConfig | None = cfg.moe
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(
            cfg.rotary_dim, max_position, cfg.rope_theta, cfg.rope_scaling, device=device
        )
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(cfg, i, cfg.linear, self.deltanet, self.make_mlp(cfg, i))
            for i in range(cfg.num_layers)
        )
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.loader = FusedWeightLoader(
            QKV_FUSED | GATE_UP_FUSED, (2 * cfg.q_size, cfg.kv_size, cfg.kv_size),
            tied_head=cfg.tie_word_embeddings,
        )  # fmt: skip

    def make_mlp(self, cfg: ArchConfig, layer_idx: int) -> nn.Module:
        if cfg.moe is not None and cfg.moe.is_moe_layer(layer_idx):
            route = type(self).route
            return SparseMoeBlock(cfg.hidden_size, cfg.moe, cfg.hidden_act, route, shared_gate=True)
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = cast(nn.Parameter, self.embed_tokens.weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]. Writes this step's K/V
        into the full-attention layers' pages and advances each request's state slot."""
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, hidden.dtype)
        step = (meta, backend, StateBatch.of(meta))
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(rope, hidden, cache, step)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.loader.load(self, weights)

    def checkpoint_target(self, hf_name: str) -> str:
        return self.loader.target(hf_name)

    def normalize_checkpoint(self, tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        if self.moe_cfg is None:
            return tensors
        return stack_experts(tensors, self.moe_cfg.num_experts)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 (text; transformers `qwen3_5_text`): the same stack with the DeltaNet's inputs
    from separate projections, and dense MLPs. Its multimodal RoPE
    (mrope) gives text, whose three position streams are equal, plain RoPE on the rotary part."""

    deltanet = SplitGatedDeltaNet


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE (text; `qwen3_5_moe_text`): experts in every layer, whose top-k weights are
    always renormalized (its config has no norm_topk_prob: the router always does it)."""

    route = staticmethod(route_softmax_normalized)
