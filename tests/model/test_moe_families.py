"""Mixture-of-experts and latent-attention families, as tiny random models, give transformers'
logits on the same weights (every position of a prompt, through paged KV)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from densa.model.arch import ArchConfig
from tests.tiny_families import CONFIGS, HYBRID, save_tiny

from .helpers import densa_logits, hf_logits

TOKENS = [1, 520, 9531, 198, 27, 1256, 42, 8000, 3, 77, 10, 11, 12, 13, 14, 4000, 31, 2]


@pytest.mark.parametrize("family", sorted(set(CONFIGS) - HYBRID))
def test_logits_match_transformers(tmp_path: Path, family: str) -> None:
    model_dir = save_tiny(family, tmp_path)
    ours, theirs = densa_logits(model_dir, TOKENS), hf_logits(model_dir, TOKENS)
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    arch = ArchConfig.from_dir(model_dir)
    if family == "qwen2_moe":  # what makes the test exercise the family's structure
        assert arch.moe is not None and arch.moe.moe_layers == (True, False)
        assert arch.moe.shared_intermediate_size == 48 and arch.attention_bias
