"""MLA latent pages: DeepSeek-V3's bytes per token (one [kv_lora_rank + rope] row per layer, no
separate V), FP8 latent pages at ~2x BF16's tokens, `densa capacity` on the real shape, and
latent pages allocated, filled and copied like K/V pages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from densa.cli import main
from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig
from densa.model.kv_layout import LatentKVCache
from densa.model.kv_pages import allocate_kv_caches, bytes_per_token, kv_capacity, page_bytes
from densa.worker import kv_io
from tests.tiny_families import save_tiny
from tests.worker.test_kv_page_copies import (
    land_through_a_step,
    make_engine,
    prefilled,
    real_values,
)

GIB = 1024**3


@pytest.fixture(scope="module")
def deepseek_v3_shape(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3's (and Kimi K2's) config.json: 61 layers, latent 512 + rope 64 (no weights)."""
    from transformers import DeepseekV3Config

    out = tmp_path_factory.mktemp("deepseek-v3-config")
    config = DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"]).to_dict()
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_latent_bytes_per_token(deepseek_v3_shape: Path) -> None:
    arch = ArchConfig.from_dir(deepseek_v3_shape)
    assert arch.num_layers == 61 and arch.mla is not None and arch.mla.latent_dim == 576
    assert bytes_per_token(arch, KVFormat.of("bfloat16")) == 61 * 576 * 2 == 70272
    # One int8 power-of-two exponent per latent row: 577 bytes per layer.
    assert bytes_per_token(arch, KVFormat.of("fp8_e4m3", "dynamic")) == 61 * 577 == 35197
    assert bytes_per_token(arch, KVFormat.of("fp8_e4m3", "static")) == 61 * 576
    bf16 = kv_capacity(arch, 64 * GIB, 64, KVFormat.of("bfloat16"))
    fp8 = kv_capacity(arch, 64 * GIB, 64, KVFormat.of("fp8_e4m3", "dynamic"))
    assert fp8.resident_tokens / bf16.resident_tokens >= 1.99  # goal 1.9x; FlashMLA's is 1.76x


def test_capacity_command_reports_the_latent(
    deepseek_v3_shape: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["capacity", "--model", str(deepseek_v3_shape), "--kv-cache-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "61 layers x MLA latent 576 values (kv_lora_rank 512 + rope 64)" in out
    fp8_row = next(line for line in out.splitlines() if line.startswith("| fp8_e4m3 | dynamic"))
    assert "| 35197 | 61 |" in fp8_row and fp8_row.endswith("| 1.997x |")


def test_latent_pages_are_allocated_filled_and_copied(tmp_path: Path, smollm2_dir: Path) -> None:
    model_dir = save_tiny("deepseek_v3", tmp_path, smollm2_dir)
    arch = ArchConfig.from_dir(model_dir)
    caches = allocate_kv_caches(arch, 10, 4, KVFormat.of("fp8_e4m3"), torch.device("cpu"))
    assert all(isinstance(c, LatentKVCache) for c in caches) and len(caches) == arch.num_layers
    cache = caches[0]
    assert cache.latent.shape == (10, 1, 4, 40) and cache.scale is not None
    allocated = sum(c.latent.nbytes + c.scale.nbytes for c in caches if c.scale is not None)
    assert allocated == 10 * page_bytes(arch, 4, KVFormat.of("fp8_e4m3"))

    # FP8 latent pages copy into an FP32 pool exactly (the real values travel, scales applied).
    source, dest = make_engine(model_dir, "fp8_e4m3"), make_engine(model_dir, "float32")
    _, src_pages, _ = prefilled(source)
    want = real_values(source, src_pages)
    assert want.shape == (arch.num_layers, 1, 6, 1, 4, 40)  # one latent part per layer
    assert want.abs().sum() > 0
    _, dst_pages = land_through_a_step(dest, kv_io.pack(source.runner.kv_caches, src_pages))
    assert torch.equal(real_values(dest, dst_pages), want)


FIXTURES = Path(__file__).parents[1] / "fixtures" / "configs"


def test_sparse_attention_pages_count_the_index_keys() -> None:
    """GLM-5.2: 78 layers of latents, an index key of 128 values in the 21 that run an indexer;
    FP8 keys carry one scale per 128-value block (static latent scales or not)."""
    glm = ArchConfig.from_dir(FIXTURES / "glm-5.2")
    assert glm.dsa is not None and glm.dsa.num_full_layers == 21
    assert bytes_per_token(glm, KVFormat.of("bfloat16")) == 78 * 576 * 2 + 21 * 128 * 2 == 95232
    assert bytes_per_token(glm, KVFormat.of("fp8_e4m3", "dynamic")) == 78 * 577 + 21 * 129 == 47715
    assert bytes_per_token(glm, KVFormat.of("fp8_e4m3", "static")) == 78 * 576 + 21 * 129
    assert bytes_per_token(glm, KVFormat.of("int8")) == 78 * 578 + 21 * 130
    glm5 = ArchConfig.from_dir(FIXTURES / "glm-5")  # every layer runs its indexer
    assert bytes_per_token(glm5, KVFormat.of("bfloat16")) == 78 * (576 + 128) * 2


def test_index_keys_are_allocated_in_the_same_pages(tmp_path: Path) -> None:
    model_dir = save_tiny("glm_moe_dsa", tmp_path)
    arch = ArchConfig.from_dir(model_dir)
    caches = allocate_kv_caches(arch, 10, 4, KVFormat.of("fp8_e4m3"), torch.device("cpu"))
    indexed = [i for i, c in enumerate(caches) if isinstance(c, LatentKVCache) and c.index]
    assert indexed == [0, 2]  # the full indexer layers; 1 and 3 reuse their choice
    index = caches[0].index  # type: ignore[union-attr]
    assert index is not None and index.scale is not None
    assert index.keys.shape == (10, 1, 4, 16) and index.keys.dtype == torch.float8_e4m3fn
    assert index.scale.shape == (10, 1, 4)  # one exponent per (page, block, slot)
    allocated = 0
    for cache in caches:
        assert isinstance(cache, LatentKVCache) and cache.scale is not None
        allocated += cache.latent.nbytes + cache.scale.nbytes
        if cache.index is not None and cache.index.scale is not None:
            allocated += cache.index.keys.nbytes + cache.index.scale.nbytes
    assert allocated == 10 * page_bytes(arch, 4, KVFormat.of("fp8_e4m3"))


def test_index_keys_in_a_dtype_of_their_own(tmp_path: Path, smollm2_dir: Path) -> None:
    """--index-kv-dtype: FP8 index keys beside float32 latents, sized and allocated so."""
    glm = ArchConfig.from_dir(FIXTURES / "glm-5.2")
    assert (
        bytes_per_token(glm, KVFormat.of("bfloat16", index_dtype="fp8_e4m3"))
        == 78 * 1152 + 21 * 129
    )
    from densa.engine.llm_engine import LLMEngine
    from densa.setup.args import EngineArgs

    model_dir = save_tiny("glm_moe_dsa", tmp_path, smollm2_dir)
    engine = LLMEngine.from_args(
        EngineArgs(
            model=str(model_dir), num_kv_pages=16, max_model_len=64, index_kv_dtype="fp8_e4m3"
        )
    )
    cache = engine.runner.kv_caches[0]
    assert isinstance(cache, LatentKVCache) and cache.index is not None
    assert cache.latent.dtype == torch.float32
    assert cache.index.kv_format.describe() == "fp8_e4m3, dynamic scales"
