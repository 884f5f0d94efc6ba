"""gpt-oss (OpenAI, 2025; transformers `gpt_oss`), written for paged KV.

What sets it apart from Llama:
- attention sinks: each head has a learned logit s_h that joins every softmax's denominator and
  contributes no value, so a head can attend to "nothing":
      p_j = exp(q k_j / sqrt(d)) / (exp(s_h) + sum_i exp(q k_i / sqrt(d)))
- sliding-window layers (128 tokens) alternating with full-attention ones (`layer_types`);
- biases on q, k, v and o;
- a mixture of experts in every layer: the router is a linear layer with a bias; a token takes
  the top-k logits and the softmax over those k alone; every expert is a clamped SwiGLU with
  biases, its gate and up rows interleaved (gate = rows 0, 2, 4 ..., up = rows 1, 3, 5 ...):
      g = min(gate, limit),  u = clamp(up, -limit, limit)
      expert(x) = W_down ((u + 1) * g * sigmoid(alpha * g)) + b_down    (alpha 1.702, limit 7)
- YaRN RoPE (factor 32 over 4096 positions, not truncated).

Checkpoints ship the experts in MXFP4 (`<param>_blocks`, `<param>_scales`: densa.formats.fp4),
which load as they are (densa.quant.shipped) and run on the FP4 kernels; a dense checkpoint
stores them as transformers' parameters, [E, in, out], transposed here to densa's [E, out, in].

Attention reads the pages a group's queries can see through one SDPA whose mask carries the
sink as an extra key slot (densa.model.local_attention.attend_window), for decode and prefill.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from densa.kernels.cpu.grouped_linear import sort_by_expert
from densa.model.arch import ArchConfig
from densa.model.attention import AttentionBackend, AttentionMetadata, LayerKVCache
from densa.model.interface import CausalLM
from densa.model.layers import RMSNorm, RotaryEmbedding
from densa.model.linear import Linear
from densa.model.local_attention import attend_window
from densa.model.stacked_linear import StackedLinear
from densa.model.weight_loading import QKV_FUSED, FusedWeightLoader

CosSin = tuple[torch.Tensor, torch.Tensor]
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # transformers' GptOssConfig defaults


class GptOssAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
        )  # fmt: skip
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.window_of(layer_idx)  # None: a full-attention layer
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=True)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=True)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))

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
        qk = RotaryEmbedding.rotate_heads(qk.view(num_tokens, -1, self.head_dim), rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, KVH, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        backend.store_kv(cache, k, v, meta)
        fresh_prefill = cache.kv_format.is_quantized  # prefill reads its own K/V unquantized
        out = torch.empty_like(q)
        for group in (meta.decode, meta.prefill):
            if group is None:
                continue
            rows = slice(group.start, group.end)
            new_kv = (k[rows], v[rows]) if fresh_prefill and group is meta.prefill else None
            out[rows] = attend_window(
                q[rows], cache, group, self.scale, self.window, new_kv, sinks=self.sinks
            )
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class GptOssRouter(nn.Module):
    """Logits x G^T + b in float32; the top-k logits, softmaxed among themselves."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float(), self.bias.float())  # [T, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids  # weights [T, k], expert ids [T, k]


class GptOssExperts(nn.Module):
    """E clamped-SwiGLU experts with biases: gate|up [E, 2I, H] (rows interleaved), down
    [E, H, I], run once per active expert over its rows (densa.kernels.cpu.grouped_linear)."""

    def __init__(
        self, num_experts: int, hidden: int, width: int, alpha: float, limit: float
    ) -> None:
        super().__init__()
        self.num_experts, self.alpha, self.limit = num_experts, alpha, limit
        self.gate_up_proj = StackedLinear(num_experts, hidden, 2 * width)
        self.down_proj = StackedLinear(num_experts, width, hidden)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * width))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor):
        """x: [T, H] -> the routing-weighted sum of each token's k experts: [T, H]."""
        num_tokens, top_k = expert_ids.shape
        order, token_of_row, segments = sort_by_expert(expert_ids, self.num_experts)
        expert_of_row = expert_ids.reshape(-1).index_select(0, order)  # [T * k], by expert
        rows = x.index_select(0, token_of_row)  # [T * k, H]
        gate_up = self.gate_up_proj(rows, segments) + self.gate_up_proj_bias[expert_of_row]
        out = self.down_proj(self.activation(gate_up), segments)
        out = out + self.down_proj_bias[expert_of_row]  # [T * k, H]
        out = out * weights.reshape(-1).index_select(0, order).unsqueeze(1).to(out.dtype)
        by_pair = out.index_select(0, torch.argsort(order))  # row t * k + j: token t, choice j
        return by_pair.view(num_tokens, top_k, -1).sum(dim=1)


class GptOssMoE(nn.Module):
    def __init__(self, cfg: ArchConfig, alpha: float, limit: float) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.router = GptOssRouter(cfg.hidden_size, moe.num_experts, moe.top_k)
        self.experts = GptOssExperts(
            moe.num_experts, cfg.hidden_size, moe.expert_intermediate_size, alpha, limit
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.router(x)
        return self.experts(x, weights, expert_ids)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GptOssAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMoE(cfg, alpha, limit)

    def forward(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), cache, meta, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# transformers' dense expert parameters ([E, in, out], no `.weight`) -> densa's stacked linears.
_DENSE_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts\.(gate_up|down)_proj)$")


class GptOssForCausalLM(CausalLM):
    def __init__(self, cfg: ArchConfig, max_position: int, device: torch.device) -> None:
        super().__init__()
        if cfg.moe is None:
            raise ValueError("gpt-oss needs its experts' settings (num_local_experts) in config")
        self.cfg = cfg
        alpha, limit = cfg.swiglu or (SWIGLU_ALPHA, SWIGLU_LIMIT)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, device=device
        )
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(cfg, i, alpha, limit) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.loader = FusedWeightLoader(
            QKV_FUSED, (cfg.q_size, cfg.kv_size, cfg.kv_size), tied_head=cfg.tie_word_embeddings
        )

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
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, hidden.dtype)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(rope, hidden, cache, meta, backend)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.loader.load(self, weights)

    def checkpoint_target(self, hf_name: str) -> str:
        return self.loader.target(hf_name)

    def normalize_checkpoint(self, tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Dense experts ([E, in, out] parameters) as stacked [E, out, in] `.weight`s; shipped
        MXFP4 experts arrive as `...gate_up_proj.weight` parts already (out-major)."""
        for name, value in tensors:
            match = _DENSE_EXPERTS.match(name)
            if match is None:
                yield name, value
            elif isinstance(value, torch.Tensor):
                yield f"{match['prefix']}.weight", value.transpose(1, 2).contiguous()
            else:
                yield f"{match['prefix']}.weight", value
