"""Tiny random-weight models of every non-Llama family, built with transformers' own config and
model classes (fixed seed, no download) and saved as HF directories with SmolLM2's tokenizer.

Sizes are chosen so each family's distinctive parts are exercised by short prompts: Gemma's
window (8 tokens) is shorter than most prompts, MoE layers route 8-16 tokens over 4-8 experts
(every expert gets some), DeepSeek's first layer is dense and its groups restrict the choice.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def _common(**extra: Any) -> dict[str, Any]:
    settings: dict[str, Any] = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return settings | extra


def qwen3() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**_common(head_dim=24))


def gemma3() -> Any:
    from transformers import Gemma3TextConfig

    layers = ["sliding_attention", "sliding_attention", "full_attention"]
    return Gemma3TextConfig(
        **_common(
            head_dim=16, num_hidden_layers=3, layer_types=layers, sliding_window=8,
            query_pre_attn_scalar=24, tie_word_embeddings=True,
        ),
        architectures=["Gemma3ForCausalLM"],
    )  # fmt: skip


def mixtral() -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(**_common(num_local_experts=8, num_experts_per_tok=2))


def qwen2_moe() -> Any:
    from transformers import Qwen2MoeConfig

    # Layer 1 is dense (mlp_only_layers); the shared expert is wider than a routed one.
    return Qwen2MoeConfig(
        **_common(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False,
        )
    )  # fmt: skip


def qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **_common(
            head_dim=24, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
            norm_topk_prob=True,
        )
    )  # fmt: skip


def deepseek_v3(**overrides: Any) -> Any:
    from transformers import DeepseekV3Config

    # Layer 0 dense, layers 1-2 MoE: 8 experts in 4 groups, the best 2 groups eligible, top 2.
    settings = _common(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )  # fmt: skip
    return DeepseekV3Config(**(settings | overrides))


def deepseek_v3_yarn() -> Any:
    """No query LoRA, and YaRN-stretched RoPE (its mscale changes the softmax scale)."""
    yarn = {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0,
    }  # fmt: skip
    return deepseek_v3(q_lora_rank=None, rope_parameters=yarn)


def _sparse(**extra: Any) -> dict[str, Any]:
    """MLA + MoE as deepseek_v3, plus an indexer choosing 16 tokens: prompts of 40-100 tokens
    leave most of each context out, so the selection decides the output. Eight indexer heads
    keep exact ties (every head's ReLU at 0) rare."""
    return (
        deepseek_v3().to_dict()
        | dict(index_topk=16, index_head_dim=16, index_n_heads=8, max_position_embeddings=1024)
        | extra
    )


def deepseek_v32() -> Any:
    from transformers import DeepseekV32Config

    return DeepseekV32Config(**config_fields(_sparse()))


def glm_moe_dsa() -> Any:
    """GLM-5's layout in small: layer 0 dense, two of four layers share the top-k before them."""
    from transformers import GlmMoeDsaConfig

    sparse = _sparse(num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"])
    return GlmMoeDsaConfig(**config_fields(sparse))


def kimi_k25() -> Any:
    """Kimi K2.5's layout in small: the tiny DeepSeek-V3 as the text model of a multimodal
    config, beside a one-layer vision tower; the output head untied, as Kimi's is."""
    from transformers.models.kimi_k25 import Kimi_K25Config

    text = config_fields(deepseek_v3().to_dict())
    vision = dict(patch_size=14, num_attention_heads=2, num_hidden_layers=1, hidden_size=32,
                  intermediate_size=64, pos_emb_height=8, pos_emb_width=8, pos_emb_time=2)  # fmt: skip
    return Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32,
                          tie_word_embeddings=False)  # fmt: skip


def config_fields(settings: dict[str, Any]) -> dict[str, Any]:
    """A config's to_dict() as its constructor takes it (the fields it derives dropped)."""
    dropped = ("architectures", "model_type", "transformers_version", "qk_head_dim", "head_dim",
               "mlp_layer_types", "layer_types", "rope_interleave")  # fmt: skip
    return {k: v for k, v in settings.items() if k not in dropped}


def gpt_oss() -> Any:
    """Sinks, sliding (8-token window) and full layers alternating, 4 clamped-SwiGLU experts
    with biases (top 2), q/k/v/o biases, YaRN RoPE (gpt-oss's factor 32 over 4096 positions)."""
    from transformers import GptOssConfig

    yarn = {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096,
    }  # fmt: skip
    settings = _common(
        intermediate_size=64, num_hidden_layers=4, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, attention_bias=True, rope_parameters=yarn,
    )  # fmt: skip
    config = GptOssConfig(**settings)
    config._attn_implementation = "eager"  # sinks: transformers' reference attention
    return config


def qwen3_next() -> Any:
    """Three Gated DeltaNet layers then one gated full-attention layer (partial RoPE, 25%),
    2 key heads serving 4 value heads, 4 experts (top 2) with a gated shared expert."""
    from transformers import Qwen3NextConfig

    settings = _common(
        num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    )  # fmt: skip
    return Qwen3NextConfig(**settings)


def _qwen3_5(**extra: Any) -> dict[str, Any]:
    return _common(
        num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, **extra,
    )  # fmt: skip


def qwen3_5() -> Any:
    """Qwen3.5 text: Qwen3-Next's stack with separate DeltaNet projections, dense MLPs."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**_qwen3_5())


def qwen3_5_moe() -> Any:
    """Qwen3.5-MoE text: every layer's MLP 4 experts (top 2) and a gated shared expert."""
    from transformers import Qwen3_5MoeTextConfig

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32)  # fmt: skip
    return Qwen3_5MoeTextConfig(**_qwen3_5(**moe))


CONFIGS: dict[str, Callable[[], Any]] = {
    "qwen3": qwen3,
    "gemma3": gemma3,
    "mixtral": mixtral,
    "qwen2_moe": qwen2_moe,
    "qwen3_moe": qwen3_moe,
    "deepseek_v3": deepseek_v3,
    "deepseek_v3_yarn": deepseek_v3_yarn,
    "deepseek_v32": deepseek_v32,
    "glm_moe_dsa": glm_moe_dsa,
    "gpt_oss": gpt_oss,
    "qwen3_next": qwen3_next,
    "qwen3_5": qwen3_5,
    "qwen3_5_moe": qwen3_5_moe,
}
# Hybrid linear-attention families: the engine refuses them until their state slots exist (issue
# 40), and their layers need a state cache, so the paged-KV family tests leave them to
# tests/model/test_qwen3_next.py.
HYBRID = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe"})
# Multimodal configs, saved with their own model class (not AutoModelForCausalLM's).
MULTIMODAL: dict[str, Callable[[], Any]] = {"kimi_k25": kimi_k25}


def save_tiny(
    family: str,
    out_dir: Path,
    tokenizer_dir: Path | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Build `family`'s tiny model with random weights (std 0.08, so logits are not flat and
    greedy ties are rare) and save it, with the tokenizer files if `tokenizer_dir` is given.
    `overrides` replace config fields."""
    from transformers import AutoModelForCausalLM

    config = (CONFIGS | MULTIMODAL)[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    if family in MULTIMODAL:
        from transformers.models.kimi_k25.modeling_kimi_k25 import (
            Kimi_K25ForConditionalGeneration,
        )

        model = Kimi_K25ForConditionalGeneration(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                continue  # a buffer in some versions; kept small so groups still matter
            param.normal_(0, 0.08)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.05)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).exists():
                shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir
