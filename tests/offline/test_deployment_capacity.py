"""`densa capacity --config --gpu --tp` on the published Kimi K2 and GLM-4.5/4.6 configs
(tests/fixtures/configs): parameter counts match the published totals, FP8 KV holds ~2x BF16's
tokens, INT4 weights are ~40% smaller than FP8, and MLA's latent is not split by TP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from densa.cli import main
from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig
from densa.offline import deployment

CONFIGS = Path(__file__).parent.parent / "fixtures" / "configs"
H200 = deployment.GPUS["h200"]
RESERVE = 4 * 2**30
BF16 = KVFormat.of("bfloat16")


def _sized(name: str, tp: int = 8) -> tuple[ArchConfig, deployment.ParamCounts, dict, dict]:
    cfg = json.loads((CONFIGS / name / "config.json").read_text())
    arch = ArchConfig.from_hf_dict(cfg)
    counts = deployment.count_parameters(cfg, arch)
    sizes = {s.name: s for s in deployment.weight_sizes(counts, tp)}
    rows = deployment.kv_rows(arch, list(sizes.values()), H200, 0.9, RESERVE, tp)
    tokens = {(r.weights, r.kv_dtype): r.tokens for r in rows}
    return arch, counts, sizes, tokens


@pytest.mark.parametrize(
    ("name", "published"), [("kimi-k2-instruct", 1.04e12), ("glm-4.5", 355e9), ("glm-4.6", 355e9)]
)
def test_parameter_counts_match_the_published_totals(name: str, published: float) -> None:
    _, counts, _, _ = _sized(name)
    assert abs(counts.served + counts.mtp - published) / published < 0.02


@pytest.mark.parametrize("name", ["kimi-k2-instruct", "glm-4.5"])
def test_fp8_kv_doubles_tokens_and_int4_weights_are_40_percent_smaller(name: str) -> None:
    _, _, sizes, tokens = _sized(name)
    for weights in ("int4 g32", "fp8 128x128"):
        ratio = tokens[(weights, "fp8_e4m3")] / tokens[(weights, "bfloat16")]
        assert 1.95 < ratio <= 2.0, (weights, ratio)
    fp8 = sizes["fp8 128x128"].checkpoint_bytes
    for int4 in ("int4 g32", "int4 g32 experts, rest fp8"):
        saved = 1 - sizes[int4].checkpoint_bytes / fp8
        assert 0.38 < saved < 0.46, (int4, saved)
    # More room for KV is where INT4 pays: more resident tokens at the same KV dtype.
    assert tokens[("int4 g32", "fp8_e4m3")] > tokens[("fp8 128x128", "fp8_e4m3")]


@pytest.mark.parametrize("name", ["kimi-k2-instruct", "glm-4.5"])
def test_fp4_weights_size_like_the_other_formats(name: str) -> None:
    """MXFP4 (4.25 bits) and NVFP4 (4.5 bits: int4 g32's size) in the same arithmetic; FP4
    experts with FP8 elsewhere (DeepSeek-V4's mix) smaller than INT4 experts with FP8."""
    _, _, sizes, tokens = _sized(name)
    bytes_of = {name: size.checkpoint_bytes for name, size in sizes.items()}
    assert bytes_of["nvfp4"] == bytes_of["int4 g32"]
    assert bytes_of["mxfp4"] < bytes_of["int4 g32"] < bytes_of["fp8 128x128"]
    assert bytes_of["mxfp4 experts, rest fp8"] < bytes_of["int4 g32 experts, rest fp8"]
    assert bytes_of["mxfp4 experts, rest fp8"] < bytes_of["mxfp4 experts, rest bf16"]
    assert tokens[("mxfp4", "fp8_e4m3")] > tokens[("int4 g32", "fp8_e4m3")]


def test_gpt_oss_20b_sizes_as_it_ships() -> None:
    """~20.9B parameters (19.1B in experts); MXFP4 experts with bf16 elsewhere is the ~13.8 GB
    the release is."""
    arch, counts, sizes, _ = _sized("gpt-oss-20b", tp=1)
    assert arch.architecture == "GptOssForCausalLM" and arch.moe is not None
    assert arch.moe.top_k == 4 and arch.layer_windows[:2] == (128, None)
    assert abs(counts.served - 20.9e9) / 20.9e9 < 0.02
    assert 13.0e9 < sizes["mxfp4 experts, rest bf16"].checkpoint_bytes < 14.5e9


def test_kv_bytes_per_token_per_gpu() -> None:
    kimi, _, _, _ = _sized("kimi-k2-instruct")
    glm, _, _, _ = _sized("glm-4.5")
    per_gpu = deployment.kv_bytes_per_token_per_gpu
    # MLA: 61 layers x (512 + 64) bf16 values on every rank, whatever the TP degree.
    assert per_gpu(kimi, BF16, 8) == per_gpu(kimi, BF16, 1) == 61 * 576 * 2
    # GQA: 92 layers x K and V x 8 heads / TP x 128 x 2 bytes; never less than one head a rank.
    assert per_gpu(glm, BF16, 4) == 92 * 2 * 2 * 128 * 2
    assert per_gpu(glm, BF16, 8) == per_gpu(glm, BF16, 16) == 47104


def test_fp8_weights_on_8_h200_are_a_tight_fit_for_kimi() -> None:
    """FP8 Kimi K2 is ~1 TB: ~130 GB of each H200's 141 GB, leaving little for KV."""
    _, _, sizes, tokens = _sized("kimi-k2-instruct")
    assert 125e9 < sizes["fp8 128x128"].per_gpu_bytes < 135e9
    assert tokens[("bf16", "bfloat16")] == 0  # BF16 weights do not fit at all
    assert tokens[("int4 g32", "bfloat16")] > 20 * tokens[("fp8 128x128", "bfloat16")]


def test_the_command_prints_the_tables_with_their_arithmetic(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = str(CONFIGS / "glm-4.5" / "config.json")
    assert main(["capacity", "--config", config, "--gpu", "h200", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "352.8B parameters served (+4.0B multi-token prediction" in out
    assert "| fp8 128x128 | 358.5 GB | 44.44 GB | (335.96B experts x 1 +" in out
    assert "KV per token per GPU: 92 layers x 2 (K, V) x 1 of 8 KV heads x head_dim 128" in out
    assert "| int4 g32 | fp8_e4m3 | 106.16 GB | 23736 | 4,472,399 | 1.984x |" in out
    assert main(["capacity", "--gpu", "h200"]) == 2  # no config


@pytest.mark.parametrize(
    ("name", "published"), [("glm-5", 744e9), ("deepseek-v3.2", 685e9), ("kimi-k2.6", 1.04e12)]
)
def test_sparse_attention_and_kimi_k25_configs_size(name: str, published: float) -> None:
    """GLM-5 and DeepSeek-V3.2 count their indexers; Kimi K2.6 sizes from its text_config."""
    _, counts, _, _ = _sized(name)
    assert abs(counts.served + counts.mtp - published) / published < 0.02


def test_index_keys_are_whole_on_every_rank() -> None:
    """GLM-5.2: 78 latent rows and 21 index keys per token on every rank, at any TP."""
    glm, _, _, tokens = _sized("glm-5.2")
    per_gpu = deployment.kv_bytes_per_token_per_gpu
    assert per_gpu(glm, BF16, 8) == per_gpu(glm, BF16, 1) == 95232
    assert per_gpu(glm, KVFormat.of("fp8_e4m3", "dynamic"), 8) == 78 * 577 + 21 * 129
    ratio = tokens[("int4 g32", "fp8_e4m3")] / tokens[("int4 g32", "bfloat16")]
    assert 1.99 < ratio <= 2.0
