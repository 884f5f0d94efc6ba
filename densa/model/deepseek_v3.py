"""DeepSeek-V3 (and Kimi K2, the same architecture): MLA attention and DeepSeekMoE MLPs.

    layer i:  h = x + MLA(norm(x));  out = h + MLP_i(norm(h))
    MLP_i     dense gated MLP for the first `first_k_dense_replace` layers, then
              shared experts (always run) + routed experts chosen by sigmoid scores with a
              load-balancing bias, within the best `topk_group` of `n_group` groups, weights
              renormalized and scaled by `routed_scaling_factor` (densa.model.moe)

The KV cache holds MLA latents (densa.model.kv_layout, "latent" layout). Checkpoint tensors of
layers past num_hidden_layers are the multi-token-prediction module, which densa does not run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from densa.model.arch import ArchConfig
from densa.model.attention import AttentionBackend, AttentionMetadata
from densa.model.family_config import MoEConfig
from densa.model.interface import CausalLM
from densa.model.kv_layout import LatentKVCache
from densa.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from densa.model.linear import Linear
from densa.model.mla import MLAttention
from densa.model.moe import SparseMoeBlock, route_grouped_sigmoid, stack_experts
from densa.model.weight_loading import GATE_UP_FUSED, FusedWeightLoader

CosSin = tuple[torch.Tensor, torch.Tensor]
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ArchConfig, moe: MoEConfig, layer_idx: int, attention: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention or MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module
        if moe.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(
                cfg.hidden_size, moe, cfg.hidden_act, route_grouped_sigmoid, correction_bias=True
            )
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cache: LatentKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual)
        hidden = self.self_attn(rope, hidden, cache, meta, backend)
        hidden, residual = self.post_attention_layernorm.forward_with_residual(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekV3ForCausalLM(CausalLM):
    def __init__(self, cfg: ArchConfig, max_position: int, device: torch.device) -> None:
        super().__init__()
        if cfg.moe is None or cfg.mla is None:
            raise ValueError("DeepseekV3ForCausalLM needs MoE and MLA settings in its config")
        self.cfg, self.moe_cfg = cfg, cfg.moe
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(
            cfg.mla.rope_head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, device=device
        )
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(cfg, cfg.moe, i) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.loader = FusedWeightLoader(GATE_UP_FUSED, tied_head=cfg.tie_word_embeddings)

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = cast(nn.Parameter, self.embed_tokens.weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LatentKVCache],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, hidden.dtype)
        residual = None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, cache, meta, backend)
        assert residual is not None
        hidden, _ = self.norm.forward_with_residual(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def normalize_checkpoint(self, tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Drop the multi-token-prediction layers, name the shared experts like Qwen2-MoE's
        (one fused MLP), stack the routed experts."""
        kept = (
            (name.replace(".shared_experts.", ".shared_expert."), value)
            for name, value in tensors
            if not self._is_mtp_layer(name)
        )
        return stack_experts(kept, self.moe_cfg.num_experts)

    def _is_mtp_layer(self, name: str) -> bool:
        match = _LAYER_INDEX.match(name)
        return match is not None and int(match[1]) >= self.cfg.num_layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.loader.load(self, weights)

    def checkpoint_target(self, hf_name: str) -> str:
        return self.loader.target(hf_name)


# Kimi K2.5+ checkpoints: the text model under language_model.*, beside a vision tower and its
# projector (not loaded). Moonshot's names, then transformers' (whose saving writes the text
# model's layers as "blocks", the vision encoder's word, and reads them back as layers).
_TEXT_MODEL_NAMES = (
    (re.compile(r"^language_model\.model\.(?:layers|blocks)\."), "model.layers."),
    (re.compile(r"^language_model\.model\."), "model."),
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
    (re.compile(r"^model\.language_model\."), "model."),
)
_VISION_PREFIXES = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")


class KimiK25ForConditionalGeneration(DeepseekV3ForCausalLM):
    """Kimi K2.5+'s text model (DeepSeek-V3) served alone: the vision tower is not loaded, and
    requests with image content are refused before they reach the engine."""

    def normalize_checkpoint(self, tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        text = (
            (_text_model_name(name), value)
            for name, value in tensors
            if not name.startswith(_VISION_PREFIXES)
        )
        return super().normalize_checkpoint(text)

    def checkpoint_target(self, hf_name: str) -> str:
        return super().checkpoint_target(_text_model_name(hf_name))


def _text_model_name(name: str) -> str:
    for pattern, replacement in _TEXT_MODEL_NAMES:
        renamed, count = pattern.subn(replacement, name, count=1)
        if count:
            return renamed
    return name
