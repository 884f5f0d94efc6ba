"""gpt-oss as it ships: a tiny random gpt-oss (sinks, 8-token sliding layers alternating with full
ones, 4 clamped-SwiGLU experts with biases) whose experts a test writer packed into MXFP4 in the
layout openai/gpt-oss ships (`_blocks` / `_scales`, shipped_producers.gpt_oss_mxfp4, from the
OCP spec) serves transformers' greedy tokens (eager attention, experts = transformers' own
dequantization of those blocks), with the experts kept as their 4-bit blocks: weight-only FP4
kernels and int8-activation ones, alone and batched with 2-token pages and chunked prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from densa.engine.llm_engine import LLMEngine
from densa.formats import fp4
from densa.kernels.cpu import native
from densa.model.fp4_linear import StackedFp4Linear
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from densa.text.tokenizer import Tokenizer
from tests.engine.reference import (
    ReferenceGeneration,
    first_divergence,
    hf_greedy,
    run_with_invariants,
)
from tests.quant.shipped_producers import gpt_oss_mxfp4, write_gpt_oss_mxfp4
from tests.tiny_families import save_tiny

TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",  # > the 8-token window
    "def fibonacci(n):\n    ",
    "List of prime numbers: 2, 3, 5, 7, 11, 13, 17, 19, 23,",
]
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
Case = tuple[Path, list[list[int]], list[ReferenceGeneration]]


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Case:
    root = tmp_path_factory.mktemp("gpt-oss")
    dense = save_tiny("gpt_oss", root / "dense", smollm2_dir, seed=1)
    write_gpt_oss_mxfp4(dense, root / "mxfp4", root / "ref")
    tokenizer = Tokenizer.from_dir(dense)
    prompts = [tokenizer.encode(text) for text in TEXTS]
    return root / "mxfp4", prompts, hf_greedy(root / "ref", prompts, MAX_NEW)


def test_the_writers_blocks_are_what_transformers_reads() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dense = torch.randn(2, 64, 96, generator=torch.Generator().manual_seed(0)) * 0.1  # [E, in, out]
    blocks, scales = gpt_oss_mxfp4(dense)
    assert blocks.shape == (2, 96, 2, 16) and scales.shape == (2, 96, 2)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    ours = fp4.dequantize_mxfp4(blocks.flatten(-2), scales)  # [E, out, in]
    assert torch.equal(ours.transpose(1, 2), theirs)
    assert (theirs - dense).abs().max() < 0.08  # at most one step (<= 2^-4 here)


def _engine(model_dir: Path, **overrides: object) -> LLMEngine:
    settings: dict[str, object] = dict(
        model=str(model_dir), max_model_len=128, num_kv_pages=128, page_size=4
    )
    return LLMEngine.from_args(EngineArgs(**(settings | overrides)))  # type: ignore[arg-type]


@pytest.mark.parametrize("weight_format", ["mxfp4", "auto"])  # weight-only, int8 activations
def test_mxfp4_gpt_oss_serves_transformers_greedy(case: Case, weight_format: str) -> None:
    model_dir, prompts, refs = case
    engine = _engine(model_dir, weight_format=weight_format)
    experts = engine.runner.model.get_submodule("layers.1.mlp.experts.gate_up_proj")
    assert type(experts) is StackedFp4Linear
    if native.is_available():  # packed for the kernels; the row-major copy is gone
        assert experts.qweight.numel() == 0
        assert experts.blocks.numel() == 4 * 128 * 64 * 17 // 32  # 4.25 bits per weight
    ours = run_with_invariants(engine, prompts, GREEDY)
    diverged = [first_divergence(o, r) for o, r in zip(ours, refs, strict=True)]
    assert diverged.count(None) >= len(prompts) - 1, diverged


def test_batched_with_small_pages_and_chunks(case: Case) -> None:
    model_dir, prompts, refs = case
    engine = _engine(model_dir, page_size=2, num_kv_pages=256, max_num_batched_tokens=12)
    ours = run_with_invariants(engine, prompts, GREEDY)
    diverged = [first_divergence(o, r) for o, r in zip(ours, refs, strict=True)]
    assert diverged.count(None) >= len(prompts) - 1, diverged


def test_densa_quantize_of_the_dequantized_model_gives_back_the_shipped_blocks(
    case: Case, tmp_path: Path
) -> None:
    """`densa quantize --weights mxfp4` of transformers' dequantization (a dense gpt-oss whose
    experts lie on the MXFP4 grid) writes the very codes and scales gpt-oss shipped."""
    from safetensors.torch import load_file

    from densa.model.quantize import QuantizeSettings, quantize_checkpoint
    from densa.quant.weight_format import WeightFormat

    model_dir, _, _ = case
    out = tmp_path / "requantized"
    settings = QuantizeSettings(WeightFormat("mxfp4"), show_progress=False)
    assert quantize_checkpoint(str(model_dir.parent / "ref"), out, settings).num_quantized == 24
    shipped, ours = (load_file(str(d / "model.safetensors")) for d in (model_dir, out))
    name = "model.layers.2.mlp.experts.down_proj"
    assert torch.equal(ours[f"{name}.weight.qweight"], shipped[f"{name}_blocks"].flatten(-2))
    assert torch.equal(ours[f"{name}.weight.scales"], shipped[f"{name}_scales"])
