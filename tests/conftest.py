"""Shared fixtures: the real SmolLM2-135M (converted once from the bundled GGUF) and tiny random models.

Tiny models use SmolLM2's tokenizer (so text round-trips) with random weights from a fixed seed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter. Triton fixes the mode when it is
# first imported, so the switch is set before any test can import it (tests/gpu, tests/quant).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from densa.engine.args import default_model_path
from densa.model.loader import resolve_model_dir

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return resolve_model_dir(default_model_path())


def make_tiny_llama(
    out_dir: Path,
    tokenizer_dir: Path,
    seed: int = 0,
    **overrides: object,
) -> Path:
    """Save a random-weight Llama (HF format, float32) that shares SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings: dict[str, object] = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    # Larger-than-default weights make the logits less flat, so greedy ties are rare.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.08)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)
