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
    return dict(
        vocab_size=10000,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **extra,
    )


@pytest.mark.parametrize(
    "family",
    ["llama_tied", "llama3_rope_scaling", "mistral", "qwen2_bias"],
)
def test_family_logits_match_transformers(tmp_path: Path, family: str) -> None:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

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
        "qwen2_bias": Qwen2Config(**_small(tie_word_embeddings=True)),
    }
    model_dir = _save(tmp_path, configs[family])
    ours, theirs = densa_logits(model_dir, TOKENS), hf_logits(model_dir, TOKENS)
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    if family == "qwen2_bias":
        assert ArchConfig.from_dir(model_dir).attention_bias


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
