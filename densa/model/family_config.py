"""The config.json blocks of mixture-of-experts, latent-attention and sparse-attention families,
read into typed, frozen settings.

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


@dataclass(frozen=True)
class DSAConfig:
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): an indexer scores every cached token for
    each query with its own small keys (one `head_dim` key per token and layer, cached) and MLA
    attends only to the best `topk` of them."""

    topk: int  # index_topk: tokens each query attends to (2048 in the released models)
    head_dim: int  # index_head_dim: width of the indexer's queries and its cached key
    num_heads: int  # index_n_heads: query heads whose ReLU scores are summed, weighted per head
    # Per layer: True where the layer runs its own indexer ("full", and caches index keys);
    # False where it reuses the top-k of the last full layer before it ("shared", GLM-5).
    full_layers: tuple[bool, ...]
    # RoPE pairs of the indexer's first rope dims: None = the family's own (DeepSeek-V3.2
    # half-split, GLM-5 interleaved); config.json's `indexer_rope_interleave` when it says.
    rope_interleave: bool | None = None

    @property
    def num_full_layers(self) -> int:
        return sum(self.full_layers)

    def full_layer_ids(self) -> list[int]:
        return [i for i, full in enumerate(self.full_layers) if full]

    def describe(self) -> str:
        return (
            f"{self.num_full_layers} indexer layers x index key {self.head_dim} values "
            f"(top {self.topk} tokens attended)"
        )


_DSA_KEYS = ("index_topk", "index_head_dim", "index_n_heads")
_INDEXER_TYPES = {"full": True, "shared": False, "F": True, "S": False}


def read_dsa(cfg: dict[str, Any], num_layers: int) -> DSAConfig | None:
    """The indexer settings, or None when config.json names none of them. A config that names
    some must name all, consistently: a ValueError names the field that is wrong."""
    present = [key for key in _DSA_KEYS if cfg.get(key) is not None]
    if not present:
        return None
    for key in _DSA_KEYS:
        if key not in present:
            raise ValueError(f"sparse attention config lacks {key!r} (it gives {present})")
        if not isinstance(cfg[key], int) or isinstance(cfg[key], bool) or cfg[key] < 1:
            raise ValueError(f"{key} must be a positive integer, got {cfg[key]!r}")
    if not cfg.get("q_lora_rank"):
        raise ValueError("sparse attention needs 'q_lora_rank': the indexer reads the query latent")
    rope_dim = int(cfg.get("qk_rope_head_dim") or 0)
    if cfg["index_head_dim"] < rope_dim:
        raise ValueError(
            f"index_head_dim {cfg['index_head_dim']} is narrower than qk_rope_head_dim {rope_dim}"
        )
    interleave = cfg.get("indexer_rope_interleave")
    return DSAConfig(
        topk=cfg["index_topk"],
        head_dim=cfg["index_head_dim"],
        num_heads=cfg["index_n_heads"],
        full_layers=_full_indexer_layers(cfg, num_layers),
        rope_interleave=None if interleave is None else bool(interleave),
    )


def _full_indexer_layers(cfg: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """`indexer_types` ("full" / "shared" per layer), else GLM's `index_topk_pattern` ("FSS..."),
    else its schedule: layer i is full when max(i - offset + 1, 0) % index_topk_freq == 0
    (offset: index_skip_topk_offset, 2 unless given), as transformers derives it. No setting:
    every layer full (DeepSeek-V3.2)."""
    kinds = cfg.get("indexer_types")
    field_name = "indexer_types"
    if kinds is None and cfg.get("index_topk_pattern") is not None:
        kinds, field_name = list(cfg["index_topk_pattern"]), "index_topk_pattern"
    if kinds is None:
        freq = max(int(cfg.get("index_topk_freq") or 1), 1)
        given = cfg.get("index_skip_topk_offset")
        offset = 2 if given is None else int(given)
        return tuple(max(i - offset + 1, 0) % freq == 0 for i in range(num_layers))
    if len(kinds) != num_layers:
        raise ValueError(f"{field_name} lists {len(kinds)} layers, the model has {num_layers}")
    unknown = sorted({str(kind) for kind in kinds} - set(_INDEXER_TYPES))
    if unknown:
        raise ValueError(f"{field_name} holds {unknown}: each layer is 'full' or 'shared'")
    full = tuple(_INDEXER_TYPES[kind] for kind in kinds)
    if not full[0]:
        raise ValueError(f"{field_name}[0] is 'shared': the first layer has no top-k to reuse")
    return full


LINEAR_LAYER = "linear_attention"  # layer_types' name for a Gated DeltaNet layer


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5): the layers of `layer_types` marked
    linear_attention keep a fixed-size state per request instead of K/V pages: a conv window of
    conv_kernel - 1 inputs over conv_dim channels, and per value head a [key_head_dim,
    value_head_dim] recurrent state."""

    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads: a q/k head serves several value heads
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int  # the causal short conv's width (4)
    linear_layers: tuple[bool, ...]  # which layers are Gated DeltaNet (the rest full attention)

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def num_linear_layers(self) -> int:
        return sum(self.linear_layers)

    def is_linear_layer(self, layer_idx: int) -> bool:
        return self.linear_layers[layer_idx]


def read_linear_attention(cfg: dict[str, Any], num_layers: int) -> LinearAttentionConfig | None:
    types = cfg.get("layer_types")
    if not cfg.get("linear_num_value_heads") or not types or LINEAR_LAYER not in types:
        return None
    if len(types) != num_layers:
        raise ValueError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
    return LinearAttentionConfig(
        num_key_heads=int(cfg["linear_num_key_heads"]),
        num_value_heads=int(cfg["linear_num_value_heads"]),
        key_head_dim=int(cfg["linear_key_head_dim"]),
        value_head_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg["linear_conv_kernel_dim"]),
        linear_layers=tuple(kind == LINEAR_LAYER for kind in types),
    )
