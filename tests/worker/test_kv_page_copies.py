"""Page copies between engines of any two KV formats, through the path a transfer takes: pages
packed on one engine (worker/kv_io.py), landed on another by a step of its runner (a KVLanding in
the SchedulerOutput) into a receiving request's reserved pages.

FP8 and INT8 pages are only meaningful together with their scales, so a copy that moved the raw
codes alone would land wrong numbers: the real values are checked here, read by the slow
reference reader, not by the code under test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from densa.engine.llm_engine import LLMEngine
from densa.formats import fp8_kv, int8_kv
from densa.kernels.reference.paged_attention import dequantize_pages
from densa.model.kv_layout import cache_parts
from densa.sampling_params import SamplingParams
from densa.sched.output import KVLanding, PackedPages
from densa.setup.args import EngineArgs
from densa.worker import kv_io

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


def real_values(engine: LLMEngine, page_ids: list[int]) -> torch.Tensor:
    """The reference reader: [num_layers, parts, n, heads, page_size, D] float32."""
    index = torch.tensor(page_ids)
    return torch.stack([
        torch.stack([dequantize_pages(values, index, scale) for values, scale in cache_parts(c)])
        for c in engine.runner.kv_caches
    ])  # fmt: skip


def land_through_a_step(engine: LLMEngine, pages: PackedPages) -> tuple[str, list[int]]:
    """Land `pages` as a transfer does: a receiving request reserves its pages, the landing is
    queued, and the engine's next step writes it. Returns the request and its pages."""
    rid = engine.add_request(PROMPT, PARAMS, remote_prefill=True)
    reserved = engine.scheduler.reserve_remote(rid)
    assert reserved is not None and reserved.first_block == 0
    landing = KVLanding(rid, reserved.dest_page_ids, reserved.dest_tags, pages, PROMPT[0])
    assert engine.scheduler.queue_landing(landing) is None
    engine.step()  # writes the pages; the request computes from its next step on
    assert not engine.scheduler.is_receiving(rid)
    return rid, reserved.dest_page_ids


def packed_real(values: torch.Tensor) -> PackedPages:
    """Real values [L, parts, n, H, P, D] as float32 pages on the wire."""
    raw: Any = values.contiguous().reshape(-1).view(torch.uint8).numpy()
    return PackedPages("float32", "none", tuple(values.shape), memoryview(raw))


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> dict[str, LLMEngine]:
    return {
        "bf16": make_engine(tiny_model_dir, "bfloat16"),
        "fp8-dynamic": make_engine(tiny_model_dir, "fp8_e4m3", "dynamic"),
        "fp8-static": make_engine(tiny_model_dir, "fp8_e4m3", "static"),
        "int8": make_engine(tiny_model_dir, "int8"),
    }


def test_packed_pages_are_the_caches_own_bytes(engines: dict[str, LLMEngine]) -> None:
    engine = engines["int8"]
    _, pages, _ = prefilled(engine)
    packed = kv_io.pack(engine.runner.kv_caches, pages)
    cache: Any = engine.runner.kv_caches[0]
    assert (packed.kv_dtype, packed.kv_scales) == ("int8", "row")
    assert packed.shape == (len(engine.runner.kv_caches), 2, 6, *cache.k.shape[1:])
    num_rows = packed.shape[0] * 2 * 6 * cache.k.shape[1] * cache.k.shape[2]
    assert packed.values.nbytes == num_rows * cache.k.shape[3]
    assert packed.row_scales is not None and packed.row_scales.nbytes == num_rows * 2


def stored(dest: str, real: torch.Tensor) -> torch.Tensor:
    """The reference store and read: real values as `dest` holds them (rows of D values)."""
    if dest == "bf16":
        return real.to(torch.bfloat16).float()
    if dest == "int8":
        return int8_kv.dequantize_rows(*int8_kv.quantize_rows(real))
    values, exponents = fp8_kv.quantize_fp8_exponent(real)  # fp8-dynamic
    return values.float() * torch.exp2(exponents.float()).unsqueeze(-1)


@pytest.mark.parametrize("source, dest", [("fp8-dynamic", "fp8-dynamic"), ("fp8-dynamic", "bf16"),
                                          ("fp8-static", "fp8-static"), ("int8", "int8"),
                                          ("fp8-dynamic", "int8"), ("int8", "bf16"),
                                          ("bf16", "fp8-dynamic")])  # fmt: skip
def test_copies_land_the_sources_values_as_the_destination_stores_them(
    engines: dict[str, LLMEngine], source: str, dest: str
) -> None:
    _, src_pages, _ = prefilled(engines[source])
    want = real_values(engines[source], src_pages)
    packed = kv_io.pack(engines[source].runner.kv_caches, src_pages)
    _, dst_pages = land_through_a_step(engines[dest], packed)
    got = real_values(engines[dest], dst_pages)
    assert torch.equal(got, want if source == dest else stored(dest, want))
    if source == dest or (source, dest) == ("fp8-dynamic", "bf16"):
        assert torch.equal(got, want)  # exact: e4m3 x a power of two is a bf16


def test_pages_landing_in_fp8_are_quantized_with_fresh_scales(
    engines: dict[str, LLMEngine],
) -> None:
    _, src_pages, _ = prefilled(engines["bf16"])
    payload = real_values(engines["bf16"], src_pages) * 1000.0  # far beyond e4m3's 448
    engine = engines["fp8-dynamic"]
    _, pages = land_through_a_step(engine, packed_real(payload))
    landed = real_values(engine, pages)
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
    payload = real_values(engines["bf16"], src_pages)
    engine = engines["int8"]
    _, pages = land_through_a_step(engine, packed_real(payload))
    landed = real_values(engine, pages)
    row_scale = (payload.abs().amax(dim=-1, keepdim=True) / 127).half().float()
    assert torch.all((landed - payload).abs() <= row_scale * 0.5 + 1e-7)


def test_a_landed_request_runs_on_from_its_first_token(engines: dict[str, LLMEngine]) -> None:
    """Landed pages are the prompt's K/V: the request decodes from them exactly as the request
    that computed them (same engine format, greedy)."""
    engine = engines["int8"]
    local, src_pages, _ = prefilled(engine)
    first = engine.scheduler.requests[local].output_token_ids[0]
    rid = engine.add_request(PROMPT, PARAMS, remote_prefill=True)
    reserved = engine.scheduler.reserve_remote(rid)
    assert reserved is not None
    packed = kv_io.pack(engine.runner.kv_caches, src_pages)
    landing = KVLanding(rid, reserved.dest_page_ids, reserved.dest_tags, packed, first)
    assert engine.scheduler.queue_landing(landing) is None
    tokens: dict[str, list[int]] = {local: [first], rid: []}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert tokens[rid] == tokens[local] and len(tokens[rid]) == PARAMS.max_tokens
    engine.check_invariants()
