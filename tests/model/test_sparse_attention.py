"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) on tiny random models whose indexer picks 16
tokens: densa's logits equal transformers' at every position of a prompt four times longer,
prefilled at once and in chunks that score keys read back from the pages; the choice is what
makes them equal (attending to the whole context gives other logits); the sparse decode over
gathered latent rows equals attention masked to the same rows; bad configs are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from densa.engine.llm_engine import LLMEngine
from densa.formats import fp8_kv
from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.attention import build_group
from densa.model.kv_layout import LatentKVCache
from densa.model.latent_attention import expanded_prefill, sparse_absorbed_decode
from densa.model.linear import Linear
from densa.setup.args import EngineArgs
from tests.tiny_families import save_tiny

from .helpers import densa_logits, hf_logits
from .test_latent_attention import HEADS, NOPE, PAGE, ROPE, SEQ_LENS, R, V, _cache, _fill

TOPK = 16
# 64 tokens: past position 16 each query attends to 16 of up to 64 tokens.
TOKENS = [1, 520, 9531, 198, 27, 1256, 42, 8000, 3, 77, 10, 11, 12, 13, 14, 4000] * 4
SPARSE_FAMILIES = ["deepseek_v32", "glm_moe_dsa"]


@pytest.fixture(scope="module", params=SPARSE_FAMILIES)
def sparse_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param))


def test_logits_match_transformers_past_the_top_k(sparse_model: Path) -> None:
    arch = ArchConfig.from_dir(sparse_model)
    assert arch.dsa is not None and arch.dsa.topk == TOPK < len(TOKENS)
    if arch.architecture == "GlmMoeDsaForCausalLM":  # layers 1 and 3 reuse the top-k before
        assert arch.dsa.full_layers == (True, False, True, False)
    theirs = hf_logits(sparse_model, TOKENS)
    for chunk_size in (None, 24):
        ours = densa_logits(sparse_model, TOKENS, chunk_size=chunk_size)
        torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


def test_the_selection_decides_the_logits(sparse_model: Path, tmp_path: Path) -> None:
    """The same weights attending to every token: equal up to position 16, different after."""
    config = json.loads((sparse_model / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"index_topk": 4096}))
    (tmp_path / "model.safetensors").symlink_to(sparse_model / "model.safetensors")
    sparse, dense = densa_logits(sparse_model, TOKENS), densa_logits(tmp_path, TOKENS)
    torch.testing.assert_close(sparse[:TOPK], dense[:TOPK], atol=2e-4, rtol=1e-4)
    # every later position moves by far more than the 2e-4 the two implementations agree to
    assert (sparse[TOPK + 8 :] - dense[TOPK + 8 :]).abs().amax(-1).min() > 5e-3


@pytest.mark.parametrize("dtype", [torch.float32, fp8_kv.FP8_DTYPE])
@torch.inference_mode()
def test_sparse_decode_equals_attention_masked_to_the_selection(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    tables = [[7, 2, 5], [0], [3, 8, 1, 6]]
    cache: LatentKVCache = _cache(dtype, num_pages=9)
    _fill(cache, tables)
    kv_b_proj = Linear(R, HEADS * (NOPE + V))
    kv_b_proj.weight.data.normal_(0, 0.2)
    q = torch.randn(len(SEQ_LENS), HEADS, NOPE + ROPE)
    group = build_group(0, tables, SEQ_LENS, [1, 1, 1], PAGE, torch.device("cpu"))
    scale = (NOPE + ROPE) ** -0.5
    positions = torch.tensor([[8, 0, 3, 5], [1, 0, -1, -1], [13, 2, 9, 4]])  # -1: none
    keep = torch.zeros_like(group.mask)
    for seq, chosen in enumerate(positions.tolist()):
        keep[seq, 0, 0, [p for p in chosen if p >= 0]] = True
    masked = expanded_prefill(q, cache, group, scale, kv_b_proj, (R, NOPE, V), mask=keep)
    weight = kv_b_proj.weight.view(HEADS, NOPE + V, R)
    q_latent = torch.cat([torch.einsum("bhn,hnr->bhr", q[..., :NOPE], weight[:, :NOPE]),
                          q[..., NOPE:]], -1)  # fmt: skip
    for backend in ("torch", "cpu"):
        o_latent = sparse_absorbed_decode(q_latent, cache, group, positions, scale, R, backend)
        sparse = torch.einsum("bhr,hvr->bhv", o_latent, weight[:, NOPE:])
        torch.testing.assert_close(sparse, masked, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"index_n_heads": None}, "'index_n_heads'"),
        ({"index_topk": 0}, "index_topk must be a positive integer"),
        ({"indexer_types": ["full", "shared"]}, "indexer_types lists 2 layers"),
        ({"indexer_types": ["shared", "full", "full", "full"]}, "indexer_types[0] is 'shared'"),
        ({"indexer_types": ["full", "half", "full", "full"]}, "['half']"),
        ({"index_head_dim": 4}, "index_head_dim 4 is narrower than qk_rope_head_dim 8"),
        ({"q_lora_rank": None}, "'q_lora_rank'"),
        ({"index_topk": None, "index_head_dim": None, "index_n_heads": None}, "index_topk, "),
    ],
)
def test_a_bad_indexer_config_is_refused_naming_the_field(
    tmp_path: Path, smollm2_dir: Path, change: dict[str, object], named: str
) -> None:
    model_dir = save_tiny("glm_moe_dsa", tmp_path / "glm", smollm2_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config = {k: v for k, v in (config | change).items() if v is not None}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises((ModelLoadError, ValueError)) as raised:
        LLMEngine.from_args(EngineArgs(model=str(model_dir), num_kv_pages=16, max_model_len=64))
    assert named in str(raised.value)
