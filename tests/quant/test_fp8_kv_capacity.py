"""FP8 KV capacity: exact bytes-per-token arithmetic, `densa capacity`, and a pool that really
holds the tokens the arithmetic promises (filled through the engine, every slot written)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from densa.cli import main
from densa.engine.llm_engine import LLMEngine
from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.kv_pages import (
    allocate_kv_caches,
    bytes_per_token,
    kv_capacity,
    num_pages_for_budget,
)
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs

GIB = 1024**3


def _arch(num_layers: int = 30, num_kv_heads: int = 3, head_dim: int = 64) -> ArchConfig:
    """SmolLM2-135M's KV shape by default (30 layers, 3 KV heads, head_dim 64)."""
    return ArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=100,
        hidden_size=num_kv_heads * head_dim * 3,
        intermediate_size=16,
        num_layers=num_layers,
        num_heads=num_kv_heads * 3,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )


def test_bytes_per_token_per_kv_dtype() -> None:
    arch = _arch()
    values = 2 * 30 * 3 * 64  # K and V, every layer and kv head
    assert bytes_per_token(arch, KVFormat.of("float32")) == 4 * values == 46080
    assert (
        bytes_per_token(arch, KVFormat.of("bfloat16"))
        == bytes_per_token(arch, KVFormat.of("float16"))
        == 23040
    )
    assert bytes_per_token(arch, KVFormat.of("fp8_e4m3", "static")) == values == 11520
    # One int8 exponent per (token, kv head, K/V, layer): 1 byte per 64 values.
    assert bytes_per_token(arch, KVFormat.of("fp8_e4m3", "dynamic")) == values + 2 * 30 * 3 == 11700


def test_capacity_arithmetic_and_the_fp8_ratio() -> None:
    arch = _arch()
    bf16 = kv_capacity(arch, 4 * GIB, 16, KVFormat.of("bfloat16"))
    fp8 = kv_capacity(arch, 4 * GIB, 16, KVFormat.of("fp8_e4m3", "dynamic"))
    assert bf16.num_pages == 4 * GIB // (23040 * 16) == 11650
    assert fp8.num_pages == 4 * GIB // (11700 * 16) == 22943
    assert (bf16.resident_tokens, fp8.resident_tokens) == (186400, 367088)
    assert fp8.scale_bytes_per_token == 180 and bf16.scale_bytes_per_token == 0
    assert fp8.max_requests(2048) == 22943 // 128 == 179
    assert fp8.max_requests(2049) == 22943 // 129  # a partial page still costs a whole one
    assert fp8.resident_tokens / bf16.resident_tokens >= 1.9
    static = kv_capacity(arch, 4 * GIB, 16, KVFormat.of("fp8_e4m3", "static"))
    assert static.resident_tokens / bf16.resident_tokens == pytest.approx(2.0, abs=1e-3)


@pytest.mark.slow
def test_default_model_fp8_holds_at_least_1_9x_bf16_tokens(smollm2_dir: Path) -> None:
    arch = ArchConfig.from_dir(smollm2_dir)
    for budget in (256 * 1024**2, 4 * GIB, 64 * GIB):
        bf16 = kv_capacity(arch, budget, 16, KVFormat.of("bfloat16"))
        fp8 = kv_capacity(arch, budget, 16, KVFormat.of("fp8_e4m3", "dynamic"))
        assert fp8.resident_tokens / bf16.resident_tokens >= 1.9


@pytest.mark.parametrize("kv_dtype, scales", [("bfloat16", "dynamic"), ("fp8_e4m3", "dynamic"),
                                              ("fp8_e4m3", "static")])  # fmt: skip
def test_allocated_tensors_fit_the_budget(kv_dtype: str, scales: str) -> None:
    arch, budget, page_size = _arch(4, 2, 32), 3_000_000, 8
    kv_format = KVFormat.of(kv_dtype, scales)
    num_pages = num_pages_for_budget(arch, page_size, kv_format, budget)
    caches = allocate_kv_caches(arch, num_pages, page_size, kv_format, torch.device("cpu"))
    # Every byte the per-layer views cover (the huge-page region behind them is padded for
    # alignment, so storage sizes over-count by up to 2 MiB of untouched address space).
    views = [t for c in caches for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None]
    used = sum(t.numel() * t.element_size() for t in views if t.dim() > 0)
    assert used == num_pages * page_size * bytes_per_token(arch, kv_format) <= budget


def test_capacity_command_prints_every_kv_dtype(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["capacity", "--model", str(tiny_model_dir), "--kv-cache-memory", "1MiB",
                 "--context-len", "100", "--page-size", "4"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    # Tiny model: 2 layers x 2 kv heads x head_dim 16 -> 256 bytes/token in BF16, 136 in FP8.
    pages = 1024**2 // (136 * 4)
    assert f"| fp8_e4m3 | dynamic | 136 | 8 | {pages} | {pages * 4} | {pages // 25} |" in out
    assert "| bfloat16 | - | 256 | 0 | 1024 | 4096 | 40 | 1.000x |" in out
    assert "| fp8_e4m3 | static | 128 | 0 | 2048 | 8192 | 81 | 2.000x |" in out
    # INT8: 16 codes + a 2-byte fp16 scale per row: 144 bytes/token (the tiny head_dim makes
    # the scale's share large: 1.78x; SmolLM2's head_dim 64 gives 1.94x).
    assert "| int8 | row | 144 | 16 | 1820 | 7280 | 72 | 1.777x |" in out


# ---- the pool really holds what the arithmetic promises ---------------------------------------
def test_fp8_pool_fills_to_its_resident_tokens(tiny_model_dir: Path) -> None:
    # Tiny model, FP8 with dynamic scales: 136 bytes/token, 544 per 4-token page; the budget
    # buys 90 pages (plus change smaller than a page) = 360 resident tokens.
    page_size, prompt_len, budget = 4, 21, 90 * 544 + 500
    arch = ArchConfig.from_dir(tiny_model_dir)
    capacity = kv_capacity(arch, budget, page_size, KVFormat.of("fp8_e4m3", "dynamic"))
    assert (capacity.num_pages, capacity.resident_tokens) == (90, 360)
    engine = LLMEngine.from_args(
        EngineArgs(model=str(tiny_model_dir), kv_cache_dtype="fp8_e4m3",
                   kv_cache_memory=f"{budget}B", page_size=page_size, max_model_len=64,
                   max_num_seqs=256, max_num_batched_tokens=4096, enable_prefix_caching=False)
    )  # fmt: skip
    assert engine.kv_manager.num_pages == capacity.num_pages
    # 15 requests each write prompt_len + 3 = 24 tokens (6 whole pages): 360 tokens in all.
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for i in range(15):
        engine.add_request([100 + i] * prompt_len, params)
    for _ in range(4):  # one prefill step, then three decode steps
        engine.step()
        engine.check_invariants()
    requests = engine.scheduler.running
    assert len(requests) == 15 and engine.scheduler.num_preemptions == 0
    assert sum(r.num_computed_tokens for r in requests) == capacity.resident_tokens
    assert engine.kv_manager.num_free_pages == 0
    # Every slot of every page was written: a stored row never keeps the zero exponent of a
    # fresh pool (its row maximum is far from [224, 448]).
    for cache in engine.runner.kv_caches:
        for scale in (cache.k_scale, cache.v_scale):
            assert scale is not None and (scale != 0).all()
    engine.step()  # each request now needs a 7th page: the full pool must preempt
    assert engine.scheduler.num_preemptions > 0


def test_fp8_where_the_build_cannot_run_it_says_what_to_use(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ModelLoadError, match="--kv-cache-dtype bfloat16"):
        LLMEngine.from_args(EngineArgs(model=str(tiny_model_dir), kv_cache_dtype="fp8_e4m3"))


def test_scales_file_needs_static_scales(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = EngineArgs(model=str(tiny_model_dir), kv_cache_dtype="fp8_e4m3",
                      kv_scales="dynamic", kv_scales_file=str(tmp_path / "s.json"))  # fmt: skip
    with pytest.raises(ValueError, match="--kv-scales static"):
        LLMEngine.from_args(args)
    assert EngineArgs(kv_scales_file="s.json").resolved_kv_scales() == "static"
    assert EngineArgs().resolved_kv_scales() == "dynamic"
