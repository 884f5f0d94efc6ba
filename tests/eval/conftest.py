"""Engines for the evaluation tests: the tiny random model in three formats, loaded once."""

from __future__ import annotations

from pathlib import Path

import pytest

from densa.engine.llm import LLM
from densa.setup.args import EngineArgs
from densa_bench.eval.formats import Format, parse_format

TINY_PAGES = 96  # x 16 tokens: room for a 1024-token context plus a few short requests


def tiny_base(model_dir: Path) -> EngineArgs:
    return EngineArgs(model=str(model_dir), num_kv_pages=TINY_PAGES, max_model_len=1024)


@pytest.fixture(scope="session")
def tiny_formats(tiny_model_dir: Path) -> dict[str, Format]:
    """ref and same: identical fp32 engines; bf16: the same weights with a bfloat16 KV cache."""
    base = tiny_base(tiny_model_dir)
    return {
        "ref": parse_format("ref:", base),
        "same": parse_format("same:", base),
        "bf16": parse_format("bf16:kv_cache_dtype=bfloat16", base),
    }


@pytest.fixture(scope="session")
def tiny_llms(tiny_formats: dict[str, Format]) -> dict[str, LLM]:
    return {label: LLM(**vars(fmt.args)) for label, fmt in tiny_formats.items()}
