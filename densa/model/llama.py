"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2 with q/k/v bias, Qwen3 with q/k
norms), written for paged KV.

forward() takes one flattened batch of tokens from many requests ([T] ids and positions) and the
step's attention metadata; there is no batch dimension and no padding in the dense layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from densa.model.arch import ArchConfig
from densa.model.attention import AttentionBackend, AttentionMetadata, LayerKVCache
from densa.model.fused_decode import FusedDecodeSwitch
from densa.model.interface import CausalLM
from densa.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from densa.model.linear import Linear
from densa.model.local_attention import paged_attention_in_window
from densa.model.weight_loading import GATE_UP_FUSED, QKV_FUSED, FusedWeightLoader

CosSin = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, qk_norm: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        # q, k and v projections fused into one matmul: one weight read, one kernel launch.
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.window = cfg.window_of(layer_idx)
        # Qwen3: every q and k head is RMS-normalized (before RoPE); one weight for all heads.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        # [KVH, D] subtracted from every rotated key before it is stored (exact: softmax ignores
        # a shift common to all keys); set after loading where k_proj has a bias, see
        # densa/model/key_centering.py.
        self.k_center: torch.Tensor | None = None

    def forward(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qk, v = self.qkv_proj(hidden).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(num_tokens, -1, self.head_dim)  # [T, H + KVH, D]: q heads, then k heads
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # q and k heads are adjacent: rotate them together, then split.
        qk = RotaryEmbedding.rotate_heads(qk, rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, KVH, D]
        if self.k_center is not None:
            k = k - self.k_center.to(k.dtype)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention_in_window(
            backend, q, k, v, cache, meta, self.scale, self.window
        )  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: ArchConfig, layer_idx: int, qk_norm: bool = False, mlp: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Any [T, hidden] -> [T, hidden] MLP: dense by default, mixture-of-experts in MoE families.
        self.mlp = mlp if mlp is not None else GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm can fold in the previous add.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual)
        hidden = self.self_attn(rope, hidden, cache, meta, backend)
        hidden, residual = self.post_attention_layernorm.forward_with_residual(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(CausalLM):
    qk_norm = False  # whether attention normalizes each q and k head (Qwen3)

    def __init__(self, cfg: ArchConfig, max_position: int, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, device=device
        )
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.fused_decode: FusedDecodeSwitch = FusedDecodeSwitch()  # off until the engine asks
        self.tie_weights()
        self.loader = FusedWeightLoader(
            QKV_FUSED | GATE_UP_FUSED, (cfg.q_size, cfg.kv_size, cfg.kv_size),
            tied_head=cfg.tie_word_embeddings,
        )  # fmt: skip

    def make_layer(self, cfg: ArchConfig, layer_idx: int) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(cfg, layer_idx, self.qk_norm)

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
        fused = self.fused_decode.decoder_for(self, kv_caches)
        if fused is not None:
            if meta.prefill is None and meta.decode is not None:  # every layer in one C++ call
                return fused.forward(input_ids, positions, meta)
            return fused.forward_layers(self, input_ids, positions, meta, backend)
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, hidden.dtype)
        residual = None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, cache, meta, backend)
        assert residual is not None  # every model has at least one layer
        hidden, _ = self.norm.forward_with_residual(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32. Called only on rows that sample."""
        return self.lm_head(hidden).float()

    # ---- weights -------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Every parameter must arrive."""
        self.loader.load(self, weights)

    def checkpoint_target(self, hf_name: str) -> str:
        """The parameter a checkpoint tensor lands in (fused projections take several)."""
        return self.loader.target(hf_name)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense): Llama's layout, with RMSNorm on each q and k head before RoPE."""

    qk_norm = True
