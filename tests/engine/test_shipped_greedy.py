"""Checkpoints as their producers ship them (DeepSeek FP8 blocks, compressed-tensors FP8 and
INT4, AutoAWQ, GPTQ with act-order) serve transformers' greedy tokens on the producer's own
dequantization of the same weights (fp32), for a tiny Llama, Qwen3-MoE, DeepSeek-V3 and GLM-5
(its indexer's projections in FP8, its prompts past the 16 tokens the indexer keeps); the
layers run in densa's FP8 / INT4 formats, not from a dense copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from densa.engine.llm_engine import LLMEngine
from densa.model.linear import Fp8Linear, Int4Linear, Linear
from densa.model.stacked_linear import StackedFp8Linear, StackedInt4Linear
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from densa.text.tokenizer import Tokenizer
from tests.conftest import make_tiny_llama
from tests.quant.shipped_producers import write_shipped
from tests.tiny_families import save_tiny

from .reference import first_divergence, hf_greedy, run_with_invariants

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Q: What is 12 times 12?\nA:",
]
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

# (family, producer, group size, the module checked, its class once loaded)
CASES = [
    ("llama", "deepseek-fp8", 128, "layers.0.mlp.down_proj", Fp8Linear),
    ("llama", "ct-fp8-channel", 128, "layers.1.self_attn.qkv_proj", Fp8Linear),
    ("llama", "ct-int4-asym", 128, "layers.0.mlp.gate_up_proj", Int4Linear),
    ("llama", "awq", 128, "layers.1.mlp.down_proj", Int4Linear),
    ("llama", "gptq", 32, "layers.0.self_attn.o_proj", Int4Linear),
    ("llama", "gptq-act", 32, "layers.0.self_attn.o_proj", Linear),  # act-order: dequantized
    ("qwen3_moe", "ct-int4-asym", 32, "layers.1.mlp.experts.down_proj", StackedInt4Linear),
    ("deepseek_v3", "deepseek-fp8", 128, "layers.1.mlp.experts.gate_up_proj", StackedFp8Linear),
    ("glm_moe_dsa", "deepseek-fp8", 128, "layers.2.self_attn.indexer.wq_b", Fp8Linear),
]


def _source(family: str, out: Path, tokenizer_dir: Path) -> Path:
    if family == "llama":  # wide enough for groups of 128 in every layer
        return make_tiny_llama(out, tokenizer_dir, hidden_size=128, intermediate_size=256)
    return save_tiny(family, out, tokenizer_dir)


@pytest.mark.parametrize(("family", "name", "group_size", "module", "kind"), CASES)
def test_shipped_checkpoint_serves_transformers_greedy(
    family: str,
    name: str,
    group_size: int,
    module: str,
    kind: type,
    tmp_path: Path,
    smollm2_dir: Path,
) -> None:
    source = _source(family, tmp_path / "src", smollm2_dir)
    shipped = write_shipped(source, tmp_path / "shipped", tmp_path / "ref", name, group_size)
    tokenizer = Tokenizer.from_dir(shipped)
    repeat = 4 if family == "glm_moe_dsa" else 1  # sparse attention: prompts past its top-k
    prompts = [tokenizer.encode(text * repeat) for text in TEXTS]
    refs = hf_greedy(tmp_path / "ref", prompts, MAX_NEW)
    engine = LLMEngine.from_args(
        EngineArgs(model=str(shipped), max_model_len=128, num_kv_pages=64, page_size=16)
    )
    model = engine.runner.model
    assert type(model.get_submodule(module)) is kind
    if family in ("deepseek_v3", "glm_moe_dsa"):  # MLA's kv_b_proj stays dense (absorbed)
        assert type(model.get_submodule("layers.0.self_attn.kv_b_proj")) is Linear
    if family == "glm_moe_dsa":  # as is the indexer's weights_proj (it decides the top-k)
        assert type(model.get_submodule("layers.0.self_attn.indexer.weights_proj")) is Linear
    ours = run_with_invariants(engine, prompts, GREEDY)
    diverged = [first_divergence(o, r) for o, r in zip(ours, refs, strict=True)]
    assert diverged.count(None) >= len(prompts) - 1, diverged
