"""The real Qwen2.5-Coder-0.5B-Instruct GGUF (CI installs it: scripts/setup.sh models-small) served
from its own blocks: every linear layer, the head and the embedding keep the file's types (mostly
Q5_0 as w5a8, Q8_0 as w8, Q4_K as w4a8, Q6_K as w6a8), resident weights stay near the file's
bytes, the next-token distributions stay close to the dequantized float32 model's on the same
file, and the engine answers a question correctly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from densa.engine.llm import LLM
from densa.kernels.cpu import native
from densa.model.arch import ArchConfig
from densa.model.gguf import GGUFFile
from densa.model.linear import resident_weight_bytes
from densa.model.loader import auto_formats, load_model, resolve_model_dir
from densa.model.packed_linear import PackedLinear, ShardedPackedLinear
from densa.model.quantized_embedding import GGUFEmbedding
from densa.sampling_params import SamplingParams
from densa.text.tokenizer import Tokenizer

from .test_gguf_quants import _logits

MODEL = "qwen2.5-coder-0.5b"
TEXT = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n'
    "        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "The capital of France is Paris, and the capital of Italy is Rome."
)

needs_kernels = pytest.mark.skipif(not native.is_available(), reason="no C++ kernels here")


def _load(path: Path, weight_format: str, head_format: str) -> tuple[nn.Module, Path]:
    model_dir = resolve_model_dir(str(path))
    weights, head = auto_formats(str(path), model_dir, weight_format, head_format)
    arch = ArchConfig.from_dir(model_dir)
    model = load_model(model_dir, arch, "float32", 256, torch.device("cpu"), weights, head)
    return model, model_dir


@needs_kernels
def test_blocks_stay_close_to_the_dequantized_model(
    real_model: Callable[[str], Path],
) -> None:
    path = real_model(MODEL)
    kept, model_dir = _load(path, "auto", "auto")
    suffixes = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
    linears = {n: m for n, m in kept.named_modules() if n.endswith(suffixes)}
    assert len(linears) == 24 * 4 + 1
    for name, module in linears.items():  # every one kept the file's blocks
        assert isinstance(module, PackedLinear | ShardedPackedLinear), name
    assert isinstance(getattr(kept, "embed_tokens"), GGUFEmbedding)  # noqa: B009
    source = GGUFFile.of_converted(model_dir)
    assert source is not None
    # w5a8 holds Q5_0 in 6 bits for the file's 5.5 (1.039x in all, 2026-12-03).
    assert resident_weight_bytes(kept) <= 1.15 * source.tensor_bytes()

    tokens = Tokenizer.from_dir(model_dir).encode(TEXT)
    got = _logits(kept, model_dir, tokens)
    del kept
    dense, _ = _load(path, "dense", "dense")
    want = _logits(dense, model_dir, tokens)
    kl = torch.nn.functional.kl_div(
        got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none"
    ).sum(-1)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert kl.mean().item() < 0.05, kl
    assert agree >= 0.9, agree


@needs_kernels
def test_the_engine_answers_from_the_files_blocks(real_model: Callable[[str], Path]) -> None:
    path = real_model(MODEL)
    llm = LLM(model=str(path), max_model_len=256, kv_cache_memory="64MiB")
    question = {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
    out = llm.chat([question], SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert "Paris" in out.text, out.text
