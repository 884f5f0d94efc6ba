"""Each supported family, as a tiny random model, gives transformers' logits on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.registry import model_factory

from .helpers import densa_logits, hf_logits

TOKENS = [1, 520, 9531, 198, 27, 1256, 42, 8000, 3, 77, 10, 11, 12, 13, 14]


def _save(out_dir: Path, config: object) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.08)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def _small(**extra: object) -> dict[str, object]:
    settings: dict[str, object] = dict(
        vocab_size=10000,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return settings | extra


@pytest.mark.parametrize(
    "family",
    [
        "llama_tied",
        "llama3_rope_scaling",
        "mistral",
        "mistral_sliding_window",
        "qwen2_bias",
        "qwen3_qk_norm",
        "gemma3",
    ],
)
def test_family_logits_match_transformers(tmp_path: Path, family: str) -> None:
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    configs = {
        "llama_tied": LlamaConfig(**_small(tie_word_embeddings=True)),
        "llama3_rope_scaling": LlamaConfig(
            **_small(
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                rope_theta=500000.0,
            )
        ),
        "mistral": MistralConfig(**_small(sliding_window=None)),
        # 15 tokens over a window of 5: most queries cannot see the start.
        "mistral_sliding_window": MistralConfig(**_small(sliding_window=5)),
        "qwen2_bias": Qwen2Config(**_small(tie_word_embeddings=True)),
        "qwen3_qk_norm": Qwen3Config(**_small(head_dim=24)),
        "gemma3": Gemma3TextConfig(
            **_small(
                head_dim=24,
                num_hidden_layers=3,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                sliding_window=4,
                query_pre_attn_scalar=32,
            ),
            architectures=["Gemma3ForCausalLM"],
        ),
    }
    model_dir = _save(tmp_path, configs[family])
    ours, theirs = densa_logits(model_dir, TOKENS), hf_logits(model_dir, TOKENS)
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    arch = ArchConfig.from_dir(model_dir)
    if family == "qwen2_bias":
        assert arch.attention_bias
    if family == "gemma3":  # what makes the test exercise Gemma's structure
        assert arch.layer_windows == (4, None, 4) and arch.local_rope_theta == 10000.0
        assert arch.rope_theta == 1_000_000.0 and arch.hidden_act == "gelu_pytorch_tanh"
        assert arch.query_scale == 32**-0.5
    if family == "mistral_sliding_window":
        assert arch.layer_windows == (5, 5)


def test_gemma3_hub_config_spelling() -> None:
    """Configs written by transformers 4.x name the pattern and the local RoPE base directly."""
    cfg = {
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 7, "num_attention_heads": 2,
        "head_dim": 4, "sliding_window": 512, "sliding_window_pattern": 6,
        "rope_theta": 1e6, "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 256,
    }  # fmt: skip
    arch = ArchConfig.from_hf_dict(cfg)
    assert arch.layer_windows == (512,) * 5 + (None, 512)
    assert (arch.rope_theta, arch.local_rope_theta) == (1e6, 1e4)


def test_half_precision_dtypes_run_close_to_fp32(tiny_model_dir: Path) -> None:
    reference = densa_logits(tiny_model_dir, TOKENS)
    for dtype in ("bfloat16", "float16"):
        logits = densa_logits(tiny_model_dir, TOKENS, dtype=dtype)
        assert logits.dtype == torch.float32  # logits are always returned in fp32
        assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.8
        assert (logits - reference).abs().max() < 0.5


def test_unsupported_architecture_is_a_clear_error() -> None:
    with pytest.raises(ModelLoadError, match="architecture 'GPT2LMHeadModel' is not supported"):
        model_factory("GPT2LMHeadModel")
