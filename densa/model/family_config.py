"""The config.json blocks of mixture-of-experts and latent-attention families, read into typed,
frozen settings.

Hugging Face families spell the same numbers differently (Mixtral `num_local_experts`, Qwen
`num_experts`, DeepSeek `n_routed_experts`); these readers map every spelling onto one meaning.
How the numbers are used (softmax or sigmoid routing, a gated or an ungated shared expert) is the
model class's business, picked by the architecture registry, never guessed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts each token is routed to
    expert_intermediate_size: int  # hidden width of one routed expert's gated MLP
    moe_layers: tuple[bool, ...]  # which layers have an MoE MLP (the others a dense one)
    # Renormalize the top-k weights to sum to 1 (Qwen, DeepSeek); Mixtral always does.
    norm_topk_prob: bool = False
    # Shared experts: a dense MLP every token also runs (Qwen2-MoE: one, gated by a sigmoid;
    # DeepSeek-V3: n_shared_experts of moe width, fused into one). 0: none.
    shared_intermediate_size: int = 0
    routed_scaling_factor: float = 1.0  # DeepSeek-V3: routed outputs are scaled by this (2.5)
    num_groups: int = 1  # DeepSeek-V3 grouped routing: experts split into groups ...
    topk_groups: int = 1  # ... and only the best `topk_groups` groups may be chosen

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..{self.num_experts} experts")
        if self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError("experts must split evenly into groups, topk_groups <= groups")

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.moe_layers[layer_idx]


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): K and V of all heads are
    decompressed from one cached latent of `kv_lora_rank` values, plus one shared RoPE key of
    `rope_head_dim` values; the cache holds only those."""

    q_lora_rank: int | None  # queries through a low-rank bottleneck (None: one projection)
    kv_lora_rank: int  # width of the cached latent c_kv
    nope_head_dim: int  # per-head query/key width without position information
    rope_head_dim: int  # per-head query width with RoPE; the key's RoPE part is shared
    v_head_dim: int  # per-head value width
    rope_interleave: bool = True  # RoPE pairs are (x0, x1), (x2, x3) ... (DeepSeek's layout)

    @property
    def qk_head_dim(self) -> int:
        return self.nope_head_dim + self.rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: the latent and the shared RoPE key."""
        return self.kv_lora_rank + self.rope_head_dim


_NUM_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def read_moe(cfg: dict[str, Any], num_layers: int) -> MoEConfig | None:
    num_experts = next((cfg[k] for k in _NUM_EXPERTS_KEYS if cfg.get(k)), 0)
    if not num_experts:
        return None
    # Mixtral's experts are as wide as a dense MLP; the others name their own width.
    width = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if cfg.get("n_shared_experts"):
        shared = int(cfg["n_shared_experts"]) * width
    return MoEConfig(
        num_experts=int(num_experts),
        top_k=int(cfg.get("num_experts_per_tok") or cfg["experts_per_token"]),  # gpt-oss: both
        expert_intermediate_size=width,
        moe_layers=_moe_layers(cfg, num_layers),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_intermediate_size=shared,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        num_groups=int(cfg.get("n_group") or 1),
        topk_groups=int(cfg.get("topk_group") or 1),
    )


def _moe_layers(cfg: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """DeepSeek: the first `first_k_dense_replace` layers are dense. Qwen: every
    `decoder_sparse_step`-th layer is MoE unless listed in `mlp_only_layers`. Mixtral: all."""
    if cfg.get("first_k_dense_replace") is not None:
        first_moe = int(cfg["first_k_dense_replace"])
        return tuple(i >= first_moe for i in range(num_layers))
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense_only = set(cfg.get("mlp_only_layers") or ())
    return tuple((i + 1) % step == 0 and i not in dense_only for i in range(num_layers))


def read_mla(cfg: dict[str, Any]) -> MLAConfig | None:
    if not cfg.get("kv_lora_rank"):
        return None
    q_lora_rank = cfg.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        nope_head_dim=int(cfg["qk_nope_head_dim"]),
        rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )
