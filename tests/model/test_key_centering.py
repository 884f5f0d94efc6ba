"""Centered keys (densa/model/key_centering.py): K is stored minus a per-layer constant, which
changes no attention output and keeps FP8 pages precise where k_proj has huge biases.

The model: a tiny Qwen2 whose k_proj bias is +-300 on the two slowest RoPE pairs of each kv head
(as Qwen2.5's checkpoints put |bias| up to 354 there) and whose q_proj bias is 1 on the same
channels, so q.k carries a large term that is nearly the same for every key. Uncentered, an
e4m3 page rounds those channels in steps of 16-32, and the logits move by several units.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from densa.engine.llm import LLM
from densa.model.key_centering import CENTERED, RAW, center_keys, key_center, key_encoding
from densa.model.layers import RotaryEmbedding
from densa.offline.scoring import iter_logits
from densa.sampling_params import SamplingParams
from tests.tiny_families import TOKENIZER_FILES

HEAD_DIM, KV_HEADS = 16, 2
SLOW_CHANNELS = (6, 7, 14, 15)  # pairs 6 and 7 of 8 (rotate-half layout: i and i + 8)
TOKENS = list(range(1000, 1160))  # 160 tokens; scored in chunks of 4: most context from pages
CHUNK = 4


@pytest.fixture(scope="module")
def outlier_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("qwen2-key-outliers")
    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
        tie_word_embeddings=True, rope_theta=1e6,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.08)
        for layer in model.model.layers:
            k_bias = layer.self_attn.k_proj.bias.view(KV_HEADS, HEAD_DIM)
            q_bias = layer.self_attn.q_proj.bias.view(-1, HEAD_DIM)
            for i, channel in enumerate(SLOW_CHANNELS):
                k_bias[:, channel] = 300.0 if i % 2 else -300.0
                q_bias[:, channel] = 1.0
    model.save_pretrained(str(out), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, out / name)
    return out


def _llm(model_dir: Path, kv: str, centered: bool) -> LLM:
    llm = LLM(
        model=str(model_dir), kv_cache_dtype=kv, kv_cache_memory="16MiB",  # type: ignore[arg-type]
        max_model_len=256, enable_prefix_caching=False,  # type: ignore[arg-type]
    )  # fmt: skip
    model = llm.engine.runner.model
    assert center_keys(model, enabled=centered) == 2  # both layers, before any page is stored
    assert key_encoding(model) == (CENTERED if centered else RAW)
    return llm


def _logits(llm: LLM) -> torch.Tensor:
    return torch.cat(list(iter_logits(llm.engine, TOKENS, CHUNK)))


def _mean_kl(ref: torch.Tensor, test: torch.Tensor) -> float:
    ref_logp, test_logp = ref.log_softmax(-1), test.log_softmax(-1)
    return float((ref_logp.exp() * (ref_logp - test_logp)).sum(-1).mean())


@pytest.fixture(scope="module")
def logits(outlier_model_dir: Path) -> dict[str, torch.Tensor]:
    runs = {"fp32": ("float32", True), "fp32-raw": ("float32", False),
            "fp8": ("fp8_e4m3", True), "fp8-raw": ("fp8_e4m3", False)}  # fmt: skip
    out = {}
    for name, (kv, centered) in runs.items():
        llm = _llm(outlier_model_dir, kv, centered)
        out[name] = _logits(llm)
    return out


def test_mean_rotation_is_the_mean_over_the_table() -> None:
    rotary = RotaryEmbedding(HEAD_DIM, 4096, 1e4)
    cos_mean, sin_mean = rotary.mean_rotation(4096)
    torch.testing.assert_close(cos_mean.float(), rotary.cos.mean(0), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin_mean.float(), rotary.sin.mean(0), atol=1e-6, rtol=0)


def test_the_center_keeps_slow_pairs_and_drops_fast_ones() -> None:
    rotary = RotaryEmbedding(HEAD_DIM, 512, 1e6)
    center = key_center(rotary, torch.full((KV_HEADS, HEAD_DIM), 10.0))
    slowest, fastest = center[:, [7, 15]], center[:, [0, 8]]
    # The slowest pair turns ~0.02 rad over the 4096 positions: its mean rotation is ~1%.
    assert torch.allclose(slowest, torch.full_like(slowest, 10.0), atol=0.2)
    assert fastest.abs().max() < 0.05


def test_centering_changes_no_output(logits: dict[str, torch.Tensor]) -> None:
    """In float32 pages, centered and raw keys give the same logits (softmax ignores the
    shift); an inexact center (not the same for every key) would move them."""
    torch.testing.assert_close(logits["fp32"], logits["fp32-raw"], atol=2e-3, rtol=1e-4)


def test_fp8_pages_stay_close_only_with_centered_keys(logits: dict[str, torch.Tensor]) -> None:
    centered = _mean_kl(logits["fp32"], logits["fp8"])
    raw = _mean_kl(logits["fp32"], logits["fp8-raw"])
    assert centered < 0.01, centered
    assert raw > 10 * centered, (raw, centered)


def test_pages_hold_the_centered_keys(outlier_model_dir: Path) -> None:
    """The page of a stored token holds its rotated key minus the center (fused C++ store and
    eager store alike): the slow channels, +-300 before, are small."""
    llm = _llm(outlier_model_dir, "float32", True)
    llm.generate([TOKENS[:20]], SamplingParams(max_tokens=4, temperature=0.0))
    cache = llm.engine.runner.kv_caches[0]
    stored = cache.k.float()[..., list(SLOW_CHANNELS)]
    # Raw: ~300 (the bias) on every stored token; centered, what is left is W_k x and the
    # rotation of a few positions against the mean over 4096 (~1% of 300 each).
    assert stored.abs().max() < 40
    assert stored.abs().max() > 0  # tokens were stored
