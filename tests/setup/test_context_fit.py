"""The default max_model_len is the model's trained context where the KV budget holds one
request of it, else the most the budget holds, said in the start-up log; the auto KV budget
does not grow with it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from densa.config import SchedulerConfig
from densa.engine.llm import LLM
from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from densa.setup.kv_sizing import auto_kv_pages, fit_max_model_len

TRAINED = 1024  # the tiny model's max_position_embeddings (tests/conftest.py)


def test_the_auto_budget_sizes_requests_at_4096_tokens_and_holds_one_whole_context() -> None:
    def pages(max_len: int, seqs: int = 32) -> int:
        return auto_kv_pages(SchedulerConfig(max_num_seqs=seqs, max_model_len=max_len), 16)

    assert pages(2048) == 32 * 128  # as before: room for 32 requests of max_model_len
    assert pages(4096) == pages(32768) == 32 * 256  # a 32k default costs no more pages
    assert pages(32768, seqs=4) == 2048  # ... and always one request of max_model_len
    assert fit_max_model_len(32768, 4096, 16) == 32768
    assert fit_max_model_len(32768, 1000, 16) == 16000


def test_the_default_is_the_trained_context(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="densa"):
        engine = LLMEngine.from_args(EngineArgs(model=str(tiny_model_dir), num_kv_pages=80))
    assert engine.config.scheduler.max_model_len == TRAINED
    assert engine.config.model.max_model_len == TRAINED
    assert f"max_model_len {TRAINED}: the model's trained context" in caplog.text


def test_a_budget_too_small_for_it_gets_the_most_it_holds(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="densa"):
        llm = LLM(str(tiny_model_dir), num_kv_pages=40)
    assert llm.engine.config.scheduler.max_model_len == 40 * 16
    assert "max_model_len 640: the most the KV cache holds (40 pages x 16 tokens)" in caplog.text
    assert "trained context is 1024" in caplog.text
    # ... and a request of that length runs to it.
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    (result,) = llm.generate([[5] * 600], params)
    assert len(result.token_ids) == 40 and result.finish_reason == "length"


def test_an_explicit_max_model_len_is_not_fitted(tiny_model_dir: Path) -> None:
    with pytest.raises(Exception, match="raise --kv-cache-memory or lower --max-model-len"):
        LLMEngine.from_args(
            EngineArgs(model=str(tiny_model_dir), num_kv_pages=40, max_model_len=1024)
        )
