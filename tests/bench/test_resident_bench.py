"""`densa bench resident`: each format's arithmetic, and reading what servers report (densa's
KV cache log line and usage, llama-server's KV buffer line and timings)."""

from __future__ import annotations

from pathlib import Path

from densa_bench.resident import cli

QWEN_1_5B = {"num_hidden_layers": 28, "num_key_value_heads": 2, "num_attention_heads": 12,
             "hidden_size": 1536}  # fmt: skip


def test_each_format_holds_its_bytes_worth_of_sessions() -> None:
    budget = 8 * 2**30
    # INT8 pages: 16 x 2 x 28 x 2 x (128 + 2) bytes; 8 GiB hold 36,873 pages, 18 sessions of 32k.
    assert cli._densa_fits(QWEN_1_5B, "int8", budget, 32768) == 18
    assert cli._densa_fits(QWEN_1_5B, "fp8_e4m3", budget, 32768) == 18
    assert cli._densa_fits(QWEN_1_5B, "bfloat16", budget, 32768) == 9
    # ... the same as 512 MiB holds of 2,048-token sessions (the default, 1/16 the size).
    assert cli._densa_fits(QWEN_1_5B, "int8", 512 * 2**20, 2048) == 18
    assert cli._llama_token_bytes(QWEN_1_5B, "f16") == 28 * 2 * 2 * 128 * 2
    assert cli._llama_token_bytes(QWEN_1_5B, "q8_0") == 28 * 2 * 2 * 128 * 34 // 32


def test_what_servers_report_is_read(tmp_path: Path) -> None:
    densa = {"usage": {"prompt_tokens": 2040, "prompt_tokens_details": {"cached_tokens": 2032}}}
    assert cli._prompt_and_cached(densa) == (2040, 2032)
    llama = {"usage": {"prompt_tokens": 2040}, "timings": {"cache_n": 2039}}
    assert cli._prompt_and_cached(llama) == (2040, 2039)
    log = tmp_path / "densa.log"
    log.write_text("INFO densa.setup.builder: KV cache: 2304 pages x 16 tokens = 36864 tokens "
                   "(int8, 511.88 MiB: --kv-cache-memory 512MiB), max_model_len 2048\n")  # fmt: skip
    assert cli._densa_kv_bytes(log) == int(511.88 * 2**20)
    log.write_text("I llama_kv_cache:        CPU KV buffer size =   544.00 MiB\n"
                   "I llama_kv_cache: size =   544.00 MiB (  2048 cells,  28 layers, 18/18 seqs), "
                   "K (q8_0):  272.00 MiB, V (q8_0):  272.00 MiB\n")  # fmt: skip
    assert cli._llama_kv_bytes(log) == 544 * 2**20
