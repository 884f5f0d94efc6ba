"""Page copies (transfers between pools, offload) carry real values across KV formats.

FP8 pages with dynamic scales are only meaningful together with their per-token exponents, so a
copy that moved the raw fp8 bytes alone would land wrong numbers. read_kv_pages returns the real
values and write_kv_pages stores them in the destination's format.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from densa.engine.args import EngineArgs
from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams

PROMPT = list(range(100, 124))  # 24 tokens = 6 full pages of 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def make_engine(model_dir: Path, kv_cache_dtype: str, kv_scales: str = "auto") -> LLMEngine:
    args = EngineArgs(
        model=str(model_dir),
        num_kv_pages=32,
        page_size=4,
        max_model_len=64,
        enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype,
        kv_scales=kv_scales,
    )
    return LLMEngine.from_args(args)


def prefilled(engine: LLMEngine) -> tuple[str, list[int], list[int]]:
    """A running request after its prefill step: (id, its first 6 pages, their tags)."""
    rid = engine.add_request(PROMPT, PARAMS)
    engine.step()
    request = engine.scheduler.requests[rid]
    return rid, request.page_ids[:6], request.page_tags[:6]


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> dict[str, LLMEngine]:
    return {
        "bf16": make_engine(tiny_model_dir, "bfloat16"),
        "fp8-dynamic": make_engine(tiny_model_dir, "fp8_e4m3", "dynamic"),
        "fp8-static": make_engine(tiny_model_dir, "fp8_e4m3", "static"),
        "int8": make_engine(tiny_model_dir, "int8"),
    }


def test_read_returns_real_values_of_every_layer(engines: dict[str, LLMEngine]) -> None:
    engine = engines["fp8-dynamic"]
    _, pages, _ = prefilled(engine)
    values = engine.runner.read_kv_pages(pages)
    cache = engine.runner.kv_caches[0]
    assert values.dtype == torch.float32
    assert values.shape == (len(engine.runner.kv_caches), 2, 6, *cache.k.shape[1:])
    assert cache.k_scale is not None
    raw = cache.k[torch.tensor(pages)].to(torch.float32)
    scale = torch.exp2(cache.k_scale[torch.tensor(pages)].to(torch.float32)).unsqueeze(-1)
    assert torch.equal(values[0, 0], raw * scale)


@pytest.mark.parametrize("source, dest", [("fp8-dynamic", "fp8-dynamic"), ("fp8-dynamic", "bf16"),
                                          ("fp8-static", "fp8-static"), ("int8", "int8")])  # fmt: skip
def test_copies_are_exact_where_the_destination_holds_the_values(
    engines: dict[str, LLMEngine], source: str, dest: str
) -> None:
    _, src_pages, _ = prefilled(engines[source])
    payload = engines[source].runner.read_kv_pages(src_pages)
    rid, dst_pages, tags = prefilled(engines[dest])
    assert engines[dest].land_kv_pages(rid, dst_pages, tags, payload)
    assert torch.equal(engines[dest].runner.read_kv_pages(dst_pages), payload)


def test_bf16_pages_landing_in_fp8_are_quantized_with_fresh_scales(
    engines: dict[str, LLMEngine],
) -> None:
    _, src_pages, _ = prefilled(engines["bf16"])
    payload = engines["bf16"].runner.read_kv_pages(src_pages) * 1000.0  # far beyond e4m3's 448
    engine = engines["fp8-dynamic"]
    rid, pages, tags = prefilled(engine)
    assert engine.land_kv_pages(rid, pages, tags, payload)
    landed = engine.runner.read_kv_pages(pages)
    assert not torch.equal(landed, payload)  # really quantized...
    # ...to e4m3's 3 mantissa bits (relative 1/16), or its subnormal step below 2**-6 of a row's
    # scale (a row's scale is at most its max / 224; half a step is 2**-10 of the scale).
    row_max = payload.abs().amax(dim=-1, keepdim=True)
    assert torch.all((landed - payload).abs() <= payload.abs() / 16 + row_max / 224 / 1024)
    assert landed.abs().max() > 448.0  # the exponents travelled: nothing clamped at 448


def test_pages_landing_in_int8_keep_half_a_step_of_each_rows_scale(
    engines: dict[str, LLMEngine],
) -> None:
    _, src_pages, _ = prefilled(engines["bf16"])
    payload = engines["bf16"].runner.read_kv_pages(src_pages)
    engine = engines["int8"]
    rid, pages, tags = prefilled(engine)
    assert engine.land_kv_pages(rid, pages, tags, payload)
    landed = engine.runner.read_kv_pages(pages)
    row_scale = (payload.abs().amax(dim=-1, keepdim=True) / 127).half().float()
    assert torch.all((landed - payload).abs() <= row_scale * 0.5 + 1e-7)
