"""DeepSeek-V3.2 and GLM-5 (GLM-MoE-DSA): DeepSeek-V3's MLA and MoE, with DeepSeek Sparse
Attention (densa.model.dsa) in every layer.

    layer i:  S   = Indexer_i(x, c_q)          full layer: its own top-k (index keys cached)
                  = S of the last full layer    shared layer (GLM-5's indexer_types)
              h   = x + MLA(norm(x)) attending only to S(t) for each query t
              out = h + MLP_i(norm(h))          dense for the first k layers, then MoE

The cache holds the latents and, in each full layer, one index key per token in the same pages
(densa.model.kv_layout, "sparse" layout). The two families differ in the indexer's RoPE pairs
(DeepSeek-V3.2 half-split, GLM-5 interleaved; config.json's `indexer_rope_interleave` wins
when it says) and in GLM-5's shared layers.
"""

from __future__ import annotations

import torch
from torch import nn

from densa.model.arch import ArchConfig
from densa.model.attention import AttentionBackend, AttentionMetadata
from densa.model.deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM
from densa.model.dsa import Indexer, Selection
from densa.model.family_config import MoEConfig
from densa.model.kv_layout import LatentKVCache
from densa.model.mla import MLAttention

CosSin = tuple[torch.Tensor, torch.Tensor]


class SparseMLAttention(MLAttention):
    """MLA restricted to the indexer's top-k; a shared layer reuses the selection it is given."""

    def __init__(self, cfg: ArchConfig, layer_idx: int, rope_interleave: bool) -> None:
        super().__init__(cfg)
        assert cfg.dsa is not None
        full = cfg.dsa.full_layers[layer_idx]
        self.indexer = Indexer(cfg, rope_interleave) if full else None

    def forward(  # type: ignore[override]
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        cache: LatentKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        selection: Selection | None,
    ) -> tuple[torch.Tensor, Selection | None]:
        c_q = self.query_latent(hidden)
        if self.indexer is not None:
            assert c_q is not None and cache.index is not None, "a full layer caches index keys"
            selection = self.indexer(hidden, c_q, rope, cache.index, meta)
        return self.attend(rope, hidden, c_q, cache, meta, backend, selection), selection


class SparseDecoderLayer(DeepseekV3DecoderLayer):
    def __init__(self, cfg: ArchConfig, moe: MoEConfig, layer_idx: int, interleave: bool) -> None:
        super().__init__(cfg, moe, layer_idx, SparseMLAttention(cfg, layer_idx, interleave))

    def forward(  # type: ignore[override]
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cache: LatentKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        selection: Selection | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Selection | None]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual)
        hidden, selection = self.self_attn(rope, hidden, cache, meta, backend, selection)
        hidden, residual = self.post_attention_layernorm.forward_with_residual(hidden, residual)
        return self.mlp(hidden), residual, selection


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    INDEXER_ROPE_INTERLEAVE = False  # DeepSeek-V3.2's indexer: half-split RoPE pairs

    def __init__(self, cfg: ArchConfig, max_position: int, device: torch.device) -> None:
        super().__init__(cfg, max_position, device)
        if cfg.dsa is None:
            raise ValueError(f"{cfg.architecture} needs the indexer settings in its config")
        interleave = cfg.dsa.rope_interleave
        if interleave is None:
            interleave = self.INDEXER_ROPE_INTERLEAVE
        assert cfg.moe is not None
        self.layers = nn.ModuleList(
            SparseDecoderLayer(cfg, cfg.moe, i, interleave) for i in range(cfg.num_layers)
        )

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
        residual, selection = None, None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual, selection = layer(
                rope, hidden, residual, cache, meta, backend, selection
            )
        assert residual is not None
        hidden, _ = self.norm.forward_with_residual(hidden, residual)
        return hidden


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    INDEXER_ROPE_INTERLEAVE = True  # GLM-5's indexer rotates interleaved pairs, as its MLA does
