"""Static FP8 KV scales: `densa calibrate-kv` records the true per-layer K/V maxima, writes a
file the engine loads, and an engine without a file uses 1.0."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from densa.cli import main
from densa.engine.llm_engine import LLMEngine
from densa.formats.fp8_kv import FP8_MAX
from densa.offline.kv_calibration import calibrate_kv_scales
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity. "
) * 6


def test_calibration_observes_the_exact_kv_maxima(tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_args(
        EngineArgs(model=str(tiny_model_dir), kv_cache_memory="4MiB", max_model_len=256)
    )
    token_ids = engine.tokenizer.encode(TEXT)[:150]
    seen: list[int] = []
    scales = calibrate_kv_scales(engine, [token_ids], "a test text", on_text=seen.append)
    assert seen == [150] and scales.calibration["num_tokens"] == 150
    # One text in a fresh fp32 pool: the pages hold exactly the K/V that went by.
    for layer, cache in enumerate(engine.runner.kv_caches):
        assert scales.calibration["k_amax"][layer] == float(cache.k.abs().max())
        assert scales.calibration["v_amax"][layer] == float(cache.v.abs().max())
    for amax, scale in zip(scales.calibration["k_amax"], scales.k, strict=True):
        assert math.log2(scale).is_integer() and FP8_MAX * scale / 2 < amax <= FP8_MAX * scale
    assert engine.runner.backend.name == "cpu"  # the observer is gone again
    assert not engine.has_unfinished_requests()


def test_calibrate_command_writes_a_file_the_engine_loads(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    text, out = tmp_path / "text.txt", tmp_path / "scales.json"
    text.write_text(TEXT)
    assert main(["calibrate-kv", "--model", str(tiny_model_dir), "--text", str(text),
                 "--num-tokens", "150", "--segment-len", "64", "--out", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert data["format"] == "densa-kv-scales/1" and data["calibration"]["num_texts"] == 3
    assert len(data["k_scale"]) == len(data["v_scale"]) == 2
    llm_engine = LLMEngine.from_args(
        EngineArgs(model=str(tiny_model_dir), kv_cache_dtype="fp8_e4m3", kv_scales_file=str(out),
                   kv_cache_memory="4MiB", max_model_len=256)
    )  # fmt: skip
    assert llm_engine.config.cache.kv_scales == "static"
    for layer, cache in enumerate(llm_engine.runner.kv_caches):
        assert cache.k_scale is not None and cache.v_scale is not None
        assert cache.k_scale.dim() == 0
        assert (float(cache.k_scale), float(cache.v_scale)) == (
            data["k_scale"][layer],
            data["v_scale"][layer],
        )
    llm_engine.add_request(llm_engine.tokenizer.encode("Hello"), SamplingParams(max_tokens=4))
    while llm_engine.has_unfinished_requests():
        outputs = llm_engine.step()
    assert outputs[-1].finished and outputs[-1].error is None


def test_static_scales_default_to_one_without_a_file(tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_args(
        EngineArgs(model=str(tiny_model_dir), kv_cache_dtype="fp8_e4m3", kv_scales="static",
                   kv_cache_memory="4MiB", max_model_len=256)
    )  # fmt: skip
    for cache in engine.runner.kv_caches:
        assert cache.k_scale is not None and float(cache.k_scale) == 1.0


def test_a_scales_file_for_another_model_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"format": "densa-kv-scales/1", "k_scale": [1.0] * 30,
                                "v_scale": [1.0] * 30}))  # fmt: skip
    with pytest.raises(Exception, match="30 layers but the model has 2"):
        LLMEngine.from_args(
            EngineArgs(model=str(tiny_model_dir), kv_cache_dtype="fp8_e4m3",
                       kv_scales_file=str(path), kv_cache_memory="4MiB")
        )  # fmt: skip
