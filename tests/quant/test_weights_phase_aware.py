"""Phase-aware weights: prefill through the high-precision weights, decode through INT4 ones of
the same model, both over one shared KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from densa.engine.llm import LLM
from densa.engine.llm_engine import LLMEngine
from densa.model.arch import ModelLoadError
from densa.model.linear import Int4Linear, resident_weight_bytes
from densa.model.quantize import QuantizeSettings, quantize_checkpoint
from densa.offline.scoring import iter_logits
from densa.quant.weight_format import WeightFormat
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from tests.conftest import make_tiny_llama

TOKENS = [1, 520, 9531, 198, 27, 1256, 42, 8000, 3, 77, 10, 11, 12, 13, 14]
SMALL = dict(num_kv_pages=32, page_size=4, max_model_len=64)


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    settings = QuantizeSettings(WeightFormat("int4", group_size=32), show_progress=False)
    return quantize_checkpoint(
        str(tiny_model_dir), tmp_path_factory.mktemp("int4"), settings
    ).output_dir


def _engine(model: Path, **kw: object) -> LLMEngine:
    return LLMEngine.from_args(EngineArgs(model=str(model), **SMALL, **kw))  # type: ignore[arg-type]


def test_prefill_logits_are_the_high_precision_models(tiny_model_dir: Path, int4_dir: Path) -> None:
    dense = _engine(tiny_model_dir)
    phased = _engine(tiny_model_dir, decode_model=str(int4_dir))
    decode_model = phased.runner.decode_model
    assert decode_model is not None
    assert isinstance(decode_model.get_submodule("layers.0.mlp.down_proj"), Int4Linear)
    expected = torch.cat(list(iter_logits(dense, TOKENS, chunk_size=6)))
    assert torch.equal(torch.cat(list(iter_logits(phased, TOKENS, chunk_size=6))), expected)
    phased.check_invariants()


def test_decode_rows_run_through_the_int4_weights(tiny_model_dir: Path, int4_dir: Path) -> None:
    dense = LLM(str(tiny_model_dir), **SMALL)
    phased = LLM(str(tiny_model_dir), decode_model=str(int4_dir), **SMALL)
    runner = phased.engine.runner
    assert runner.decode_model is not None
    rows: dict[str, list[int]] = {"prefill": [], "decode": []}
    runner.model.register_forward_pre_hook(lambda m, args: rows["prefill"].append(len(args[0])))
    runner.decode_model.register_forward_pre_hook(
        lambda m, args: rows["decode"].append(len(args[0]))
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [TOKENS[:9], TOKENS[3:15]]
    got = phased.generate(prompts, params)
    want = dense.generate(prompts, params)
    # The first token of each request is sampled from prefill logits: the dense model's.
    assert [r.token_ids[0] for r in got] == [r.token_ids[0] for r in want]
    assert all(len(r.token_ids) == 6 for r in got)
    assert rows["decode"] and set(rows["decode"]) <= {1, 2}  # one row per running request
    assert min(rows["prefill"]) > 1  # prefill chunks only
    assert sum(rows["decode"]) == 2 * 5  # every later token came from the int4 weights


def test_memory_cost_and_mismatch(
    tiny_model_dir: Path, int4_dir: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    phased = _engine(tiny_model_dir, decode_model=str(int4_dir))
    decode_model = phased.runner.decode_model
    assert decode_model is not None
    # The decode set costs its own bytes: here the (untied) embedding and head dominate.
    assert resident_weight_bytes(decode_model) < resident_weight_bytes(phased.runner.model)
    other = make_tiny_llama(tmp_path / "other", smollm2_dir, hidden_size=32)
    with pytest.raises(ModelLoadError, match="not the same model"):
        _engine(tiny_model_dir, decode_model=str(other))


@pytest.mark.slow
def test_smollm2_phase_aware_end_to_end(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    settings = QuantizeSettings(WeightFormat("int4", group_size=64), show_progress=False)
    int4 = quantize_checkpoint(str(smollm2_dir), tmp_path_factory.mktemp("smol-int4"), settings)
    llm = LLM(
        str(smollm2_dir), decode_model=str(int4.output_dir), num_kv_pages=64, max_model_len=256
    )
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answer = llm.chat(question, SamplingParams(max_tokens=12, temperature=0.0))[0].text
    assert "Paris" in answer, answer
