"""`densa bench dsa` on small attention dims: both variants timed at every context, the bytes
each reads counted as the paths read them (DSA: every index key and the top-k latent rows;
dense: every latent row), and the report's tables and plots written."""

from __future__ import annotations

import json
from pathlib import Path

from densa.model.arch import ArchConfig
from densa_bench.dsa.runner import kv_bytes_read, model_config, run_dsa
from densa_bench.dsa.settings import DsaSettings

SMALL = {
    "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "index_topk": 64, "index_head_dim": 16, "index_n_heads": 4,
}  # fmt: skip


def test_kv_bytes_read_by_each_path() -> None:
    settings = DsaSettings(contexts=(32, 1024))
    arch = ArchConfig.from_hf_dict(model_config(settings))  # GLM-5's attention dims
    # dense: every 576-value latent row; DSA: every 128-value index key, 2048 latent rows
    assert kv_bytes_read(arch, "bfloat16", 32768, 1, 1, False) == 32768 * 1152
    assert kv_bytes_read(arch, "bfloat16", 32768, 1, 1, True) == 32768 * 256 + 2048 * 1152
    assert kv_bytes_read(arch, "fp8_e4m3", 32768, 1, 1, True) == 32768 * 129 + 2048 * 577
    # within the top-k nothing is chosen: DSA reads what dense MLA reads
    assert kv_bytes_read(arch, "bfloat16", 2048, 1, 1, True) == 2048 * 1152
    # GLM-5.2's pattern: 21 of 78 layers read index keys, every layer its top-k rows
    dense = kv_bytes_read(arch, "bfloat16", 32768, 78, 78, False)
    assert kv_bytes_read(arch, "bfloat16", 32768, 78, 21, True) / dense < 1 / 8


def test_bench_dsa_small(tmp_path: Path) -> None:
    settings = DsaSettings(contexts=(32, 256), repeats=1, kv_dtypes=("float32", "fp8_e4m3"))
    report = run_dsa(settings, SMALL)
    assert len(report.samples) == 2 * 2 * 2  # formats x contexts x variants
    long = [s for s in report.samples if s["context"] == 256 and s["kv_dtype"] == "float32"]
    dsa, dense = sorted(long, key=lambda s: s["variant"] != "dsa")
    assert dsa["kv_bytes_per_layer"] < dense["kv_bytes_per_layer"]
    assert all(s["step_ms"] > 0 and s["attention_ms"] > 0 for s in report.samples)
    paths = report.write(tmp_path)
    assert {p.name for p in paths} >= {"results.json", "README.md", "attention_float32.png"}
    assert json.loads((tmp_path / "results.json").read_text())["name"] == "dsa"
