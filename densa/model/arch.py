"""The hyper-parameters of a decoder-only transformer, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from densa.model.family_config import (
    DSAConfig,
    LinearAttentionConfig,
    MLAConfig,
    MoEConfig,
    read_dsa,
    read_linear_attention,
    read_mla,
    read_moe,
)


class ModelLoadError(RuntimeError):
    """The model cannot be loaded; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class ArchConfig:
    architecture: str  # e.g. "LlamaForCausalLM"; selects the model class in the registry
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads: grouped-query attention
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool  # lm_head shares the embedding matrix (SmolLM2 does)
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2 style)
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Local attention: layer_windows[i] is layer i's window (keys a query may see, itself
    # included), None for a global layer; empty when every layer is global. Gemma 3 interleaves
    # five sliding layers with one global one; Mistral slides in every layer.
    layer_windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = (
        None  # RoPE base of sliding layers, if not rope_theta (Gemma 3)
    )
    query_scale: float | None = None  # softmax scale; None = head_dim ** -0.5 (Gemma: its own)
    hidden_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_pytorch_tanh
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c) when set
    moe: MoEConfig | None = None  # mixture-of-experts MLPs (which layers, routing numbers)
    mla: MLAConfig | None = None  # multi-head latent attention dimensions (DeepSeek-V3)
    dsa: DSAConfig | None = None  # sparse attention's indexer (DeepSeek-V3.2, GLM-5)
    # gpt-oss's clamped SwiGLU: (alpha, limit) of g * sigmoid(alpha g), g and u clamped to limit
    swiglu: tuple[float, float] | None = None
    # Gated DeltaNet layers beside the full-attention ones (Qwen3-Next, Qwen3.5): hybrid models
    linear: LinearAttentionConfig | None = None
    # RoPE rotates only the first rotary_fraction of each head (Qwen3-Next: 0.25)
    rotary_fraction: float = 1.0

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ArchConfig:
        cfg = _text_model(cfg)
        architectures = cfg.get("architectures") or ["?"]
        num_heads = int(cfg["num_attention_heads"])
        hidden_size = int(cfg["hidden_size"])
        num_layers = int(cfg["num_hidden_layers"])
        mla = read_mla(cfg)
        return cls(
            architecture=architectures[0],
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            # MLA's "head_dim" is its RoPE width; its K/V widths live in `mla`.
            head_dim=_head_dim(cfg, hidden_size, num_heads, mla),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(cfg, architectures[0]),
            rope_scaling=_rope_scaling(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_ids(cfg.get("eos_token_id")),
            layer_windows=_layer_windows(cfg, num_layers),
            local_rope_theta=_local_rope_theta(cfg),
            query_scale=_query_scale(cfg),
            hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
            final_logit_softcapping=_optional_float(cfg.get("final_logit_softcapping")),
            moe=read_moe(cfg, num_layers),
            mla=mla,
            dsa=read_dsa(cfg, num_layers),
            swiglu=_swiglu(cfg),
            linear=read_linear_attention(cfg, num_layers),
            rotary_fraction=_rotary_fraction(cfg),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ArchConfig:
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(
                f"{model_dir} has no config.json: not a Hugging Face model directory"
            )
        try:
            cfg = json.loads(config_path.read_text())
            arch = cls.from_hf_dict(cfg)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {config_path}: {exc!r}") from exc
        return replace(arch, eos_token_ids=arch.eos_token_ids + _generation_eos(model_dir, arch))

    @property
    def rotary_dim(self) -> int:
        """Leading values of each q/k head that RoPE rotates (all of them but in Qwen3-Next)."""
        return int(self.head_dim * self.rotary_fraction)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window_of(self, layer_idx: int) -> int | None:
        """Layer `layer_idx`'s attention window, or None for global attention."""
        return self.layer_windows[layer_idx] if self.layer_windows else None

    def signature(self) -> dict[str, Any]:
        """The shapes two workers must share to serve as one model (and exchange KV pages)."""
        keys = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "rope_theta", "max_position_embeddings")  # fmt: skip
        signature: dict[str, Any] = {key: getattr(self, key) for key in keys}
        # routing, latent, index key and linear-state shapes must match; "linear" only where
        # set, so the signatures (and fingerprints) of the other families stay as they were
        parts = ("moe", "mla", "dsa") + (("linear",) if self.linear is not None else ())
        for part in parts:
            value = getattr(self, part)
            # tuples as lists: as a peer's signature reads after msgpack (the handshake compares)
            fields = {} if value is None else asdict(value)
            signature[part] = (
                None
                if value is None
                else {
                    key: list(item) if isinstance(item, tuple) else item
                    for key, item in fields.items()
                }
            )
        return signature


def _text_model(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's text model (Kimi K2.5+: a DeepSeek-V3 text model in `text_config`
    beside a vision tower), under the outer architecture name, which the registry knows; the
    outer config's token ids and head tying apply where it states them. Other configs as given."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    outer = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None}
    merged = outer | text | {"architectures": cfg.get("architectures")}
    if "tie_word_embeddings" in cfg:  # transformers ties by the outer config's flag
        merged["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return merged


# Families with per-layer RoPE settings (Gemma 3) key rope_parameters by layer type.
GLOBAL_LAYER, SLIDING_LAYER = "full_attention", "sliding_attention"


def _global_rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers 5.x moved rope settings into "rope_parameters", per layer type for Gemma 3.
    params = cfg.get("rope_parameters") or {}
    return params.get(GLOBAL_LAYER) or params


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = _global_rope_params(cfg)
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    scaling = cfg.get("rope_scaling") or _global_rope_params(cfg)
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return None if kind == "default" else dict(scaling, rope_type=kind)


def _rotary_fraction(cfg: dict[str, Any]) -> float:
    params = _global_rope_params(cfg)
    return float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)


def _local_rope_theta(cfg: dict[str, Any]) -> float | None:
    local = (cfg.get("rope_parameters") or {}).get(SLIDING_LAYER) or {}
    theta = cfg.get("rope_local_base_freq") or local.get("rope_theta")
    return float(theta) if theta else None


def _layer_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per-layer windows from `layer_types` (or Gemma 3's older `sliding_window_pattern`: every
    n-th layer global); a window without layer types (Mistral) applies to every layer."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return ()
    types = cfg.get("layer_types")
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
    if types is None and pattern:
        types = [GLOBAL_LAYER if (i + 1) % int(pattern) == 0 else SLIDING_LAYER
                 for i in range(num_layers)]  # fmt: skip
    if types is None:
        types = [SLIDING_LAYER] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
    if SLIDING_LAYER not in types:
        return ()
    return tuple(int(window) if kind == SLIDING_LAYER else None for kind in types)


def _head_dim(cfg: dict[str, Any], hidden_size: int, num_heads: int, mla: MLAConfig | None) -> int:
    if mla is not None:
        return mla.rope_head_dim
    return int(cfg.get("head_dim") or hidden_size // num_heads)


def _query_scale(cfg: dict[str, Any]) -> float | None:
    scalar = cfg.get("query_pre_attn_scalar")
    return float(scalar) ** -0.5 if scalar else None


def _swiglu(cfg: dict[str, Any]) -> tuple[float, float] | None:
    if cfg.get("swiglu_limit") is None:
        return None
    return float(cfg.get("swiglu_alpha", 1.702)), float(cfg["swiglu_limit"])


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _attention_bias(cfg: dict[str, Any], architecture: str) -> bool:
    for key in ("attention_bias", "qkv_bias"):  # Qwen2-MoE spells it qkv_bias
        if key in cfg:
            return bool(cfg[key])
    # Qwen2 and Qwen2-MoE always have q/k/v biases; older configs do not say so.
    return architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")


def _generation_eos(model_dir: Path, arch: ArchConfig) -> tuple[int, ...]:
    """The end-of-generation tokens generation_config.json adds to config.json's (an instruct
    model's config often names one, its generation config every token that ends a turn, as
    Qwen2.5's does: [<|im_end|>, <|endoftext|>])."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        ids = _as_ids(json.loads(path.read_text()).get("eos_token_id"))
    except (json.JSONDecodeError, TypeError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc!r}") from exc
    return tuple(i for i in dict.fromkeys(ids) if i not in arch.eos_token_ids)


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
