"""The hyper-parameters of a decoder-only transformer, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
    # Mistral/Qwen2 may attend to a window only; densa attends fully, so contexts are capped to it.
    sliding_window: int | None = None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ArchConfig:
        architectures = cfg.get("architectures") or ["?"]
        num_heads = int(cfg["num_attention_heads"])
        hidden_size = int(cfg["hidden_size"])
        return cls(
            architecture=architectures[0],
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(cfg, architectures[0]),
            rope_scaling=_rope_scaling(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_ids(cfg.get("eos_token_id")),
            sliding_window=_sliding_window(cfg),
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
            return cls.from_hf_dict(cfg)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {config_path}: {exc!r}") from exc

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, bytes_per_value: float) -> float:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value

    def signature(self) -> dict[str, Any]:
        """The shapes two workers must share to serve as one model (and exchange KV pages)."""
        keys = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "rope_theta", "max_position_embeddings")  # fmt: skip
        return {key: getattr(self, key) for key in keys}

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        per_layer = attn + 3 * h * i + 2 * h
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + lm_head


def _rope_theta(cfg: dict[str, Any]) -> float:
    # transformers 5.x moved rope settings into "rope_parameters".
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return None if kind == "default" else dict(scaling, rope_type=kind)


def _attention_bias(cfg: dict[str, Any], architecture: str) -> bool:
    if "attention_bias" in cfg:
        return bool(cfg["attention_bias"])
    return architecture == "Qwen2ForCausalLM"  # Qwen2 always has q/k/v biases


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return None
    return int(window)


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
