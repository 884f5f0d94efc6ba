"""Multi-head latent attention (MLA; DeepSeek-V2 sec. 2.1, used by DeepSeek-V3 and Kimi K2).

    c_q    = norm(x W_dq)                     [T, q_lora_rank]     (or q = x W_q without LoRA)
    q      = c_q W_uq                         [T, H, nope + rope]  -> q_nope, q_rope
    c_kv   = norm(x W_dkv[:r]),  k_rope = (x W_dkv)[r:]     [T, r], [T, rope]  (shared by heads)
    cached per token: [c_kv | RoPE(k_rope)]   r + rope values (576 for DeepSeek-V3: 512 + 64)
    k_nope, v = c_kv W_ukv                    [T, H, nope], [T, H, v]  (kv_b_proj)
    o      = softmax((q_nope.k_nope + RoPE(q_rope).k_rope) * scale) v,  out = o W_o

Prefill attends "expanded" (decompressing k_nope and v); decode attends "absorbed" over the
latent pages (densa.model.latent_attention). kv_b_proj therefore stays a plain matrix in every
weight format: decode folds its rows into the query and the output.
"""

from __future__ import annotations

import torch
from torch import nn

from densa.model.arch import ArchConfig
from densa.model.attention import AttentionBackend, AttentionGroup, AttentionMetadata
from densa.model.dsa import Selection
from densa.model.kv_layout import LatentKVCache
from densa.model.latent_attention import (
    absorbed_decode,
    expanded_prefill,
    sparse_absorbed_decode,
    store_latent,
)
from densa.model.layers import RMSNorm, RotaryEmbedding, yarn_mscale
from densa.model.linear import Linear

CosSin = tuple[torch.Tensor, torch.Tensor]
LORA_NORM_EPS = 1e-6  # the reference implementation's q_a / kv_a norms ignore the config's eps


def mla_softmax_scale(cfg: ArchConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale squared when the context is stretched."""
    assert cfg.mla is not None
    scale = cfg.mla.qk_head_dim**-0.5
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    return scale


class MLAttention(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        if cfg.mla is None:
            raise ValueError(f"{cfg.architecture} needs latent-attention settings in its config")
        m = cfg.mla
        self.num_heads, self.m = cfg.num_heads, m
        self.scale = mla_softmax_scale(cfg)
        q_width = cfg.num_heads * m.qk_head_dim
        if m.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, q_width)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, m.q_lora_rank, cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(m.q_lora_rank, q_width)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, m.latent_dim, cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = Linear(m.kv_lora_rank, cfg.num_heads * (m.nope_head_dim + m.v_head_dim))
        self.o_proj = Linear(cfg.num_heads * m.v_head_dim, cfg.hidden_size, cfg.attention_bias)
        self.rotate = (
            RotaryEmbedding.rotate_interleaved
            if m.rope_interleave
            else RotaryEmbedding.rotate_heads
        )

    def forward(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        cache: LatentKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        return self.attend(rope, hidden, self.query_latent(hidden), cache, meta, backend)

    def query_latent(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """c_q = norm(x W_dq) [T, q_lora_rank], or None without query LoRA."""
        if self.m.q_lora_rank is None:
            return None
        return self.q_a_layernorm(self.q_a_proj(hidden))

    def attend(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        c_q: torch.Tensor | None,
        cache: LatentKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        selection: Selection | None = None,
    ) -> torch.Tensor:
        """Store this step's latents and attend: to the whole context, or (sparse attention)
        to the tokens `selection` chose for each query."""
        num_tokens, m = hidden.shape[0], self.m
        q = self.q_proj(hidden) if c_q is None else self.q_b_proj(c_q)
        q = q.view(num_tokens, self.num_heads, m.qk_head_dim)
        q_nope, q_rope = q.split([m.nope_head_dim, m.rope_head_dim], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(hidden).split([m.kv_lora_rank, m.rope_head_dim], -1)
        k_rope = self.rotate(k_rope.view(num_tokens, 1, m.rope_head_dim), rope)[:, 0]
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_rope], dim=-1)  # [T, r + rope]
        store_latent(cache, latent, meta)
        q_rope = self.rotate(q_rope, rope)
        selection = selection or Selection()
        out = q.new_empty(num_tokens, self.num_heads, m.v_head_dim)
        if meta.decode is not None:
            rows = slice(meta.decode.start, meta.decode.end)
            out[rows] = self._decode(
                q_nope[rows], q_rope[rows], cache, meta.decode, backend, selection.decode
            )
        if meta.prefill is not None:
            group = meta.prefill
            rows = slice(group.start, group.end)
            fresh = latent[rows] if cache.kv_format.is_quantized else None
            out[rows] = expanded_prefill(
                torch.cat([q_nope[rows], q_rope[rows]], dim=-1), cache, group, self.scale,
                self.kv_b_proj, (m.kv_lora_rank, m.nope_head_dim, m.v_head_dim), fresh,
                selection.prefill,
            )  # fmt: skip
        return self.o_proj(out.reshape(num_tokens, self.num_heads * m.v_head_dim))

    def _decode(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        cache: LatentKVCache,
        group: AttentionGroup,
        backend: AttentionBackend,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """Absorbed decode: [B, H, nope], [B, H, rope] -> [B, H, v]; over the selected
        `positions` ([B, k]) only, when given."""
        m = self.m
        w_uk, w_uv = self.absorbed_weights()  # [H, nope, r], [H, v, r]
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)  # W_uk folded into the query
        q_latent = torch.cat([q_latent, q_rope], dim=-1)
        if positions is None:
            o_latent = absorbed_decode(
                q_latent, cache, group, self.scale, m.kv_lora_rank, backend.name
            )  # fmt: skip  -> [B, H, r]
        else:
            o_latent = sparse_absorbed_decode(
                q_latent, cache, group, positions, self.scale, m.kv_lora_rank, backend.name
            )
        return torch.einsum("bhr,hvr->bhv", o_latent, w_uv)  # W_uv folded into the output

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's rows per head: W_uk [H, nope, r] and W_uv [H, v, r] (views, no copy)."""
        m = self.m
        weight = self.kv_b_proj.weight.view(self.num_heads, m.nope_head_dim + m.v_head_dim, -1)
        return weight[:, : m.nope_head_dim], weight[:, m.nope_head_dim :]
