"""`densa eval split`: the continuation scored after a real KV handoff, vs co-location.

The tiny model, two prefill/decode pairs: identical formats on both sides (the split must then
be the co-located engine, bit for bit), and an FP32-KV prefill feeding an FP8-KV decode."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from densa.cli import main
from densa.engine.llm_engine import LLMEngine
from densa.offline.inproc_pair import InProcessPair
from densa_bench.eval.distribution import text_segments
from densa_bench.eval.split import HandoffTally, SplitResult, compare_split, split_logits

from .conftest import TINY_PAGES, tiny_base

NUM_SEGMENTS, SEGMENT_LEN, PROMPT_LEN, CHUNK = 3, 128, 64, 16
PAGE_SIZE = 16
FP32_PAGE_BYTES = 8192  # the tiny model: 2 (K, V) x layers x KV heads x head dim x 16 x 4 B


def _engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    return LLMEngine.from_args(dataclasses.replace(tiny_base(model_dir), **overrides))


@pytest.fixture(scope="module")
def segments(tiny_model_dir: Path) -> list[list[int]]:
    engine = _engine(tiny_model_dir)
    return text_segments(engine.tokenizer, NUM_SEGMENTS, SEGMENT_LEN)


class ChunkLog:
    """Every position range the decode engine's runner computed, by whichever path."""

    def __init__(self, engine: LLMEngine) -> None:
        self.ranges: list[tuple[int, int]] = []
        runner = engine.runner
        runner.score = self._recording(runner.score)  # type: ignore[method-assign]
        runner.execute = self._recording(runner.execute)  # type: ignore[method-assign]

    def _recording(self, method: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def call(step: Any) -> Any:
            self.ranges += [(c.start_pos, c.start_pos + len(c.token_ids)) for c in step.scheduled]
            return method(step)

        return call


def _split_run(
    model_dir: Path, segments: list[list[int]], decode_args: dict[str, Any]
) -> tuple[SplitResult, ChunkLog]:
    ref, prefill = _engine(model_dir), _engine(model_dir)
    decode, colocated = _engine(model_dir, **decode_args), _engine(model_dir, **decode_args)
    pair = InProcessPair(prefill, decode)
    log = ChunkLog(decode)
    try:
        result = compare_split(
            ref, pair, {"colocated": colocated}, "split", segments, PROMPT_LEN, CHUNK
        )
    finally:
        pair.close()
    for engine in (ref, prefill, decode, colocated):
        engine.check_invariants()
        assert not engine.has_unfinished_requests() and not engine.scheduler.held
    return result, log


@pytest.fixture(scope="module")
def same_formats(tiny_model_dir: Path, segments: list[list[int]]) -> tuple[SplitResult, ChunkLog]:
    return _split_run(tiny_model_dir, segments, {})


def test_with_identical_formats_the_split_is_the_colocated_engine(
    same_formats: tuple[SplitResult, ChunkLog],
) -> None:
    result, _ = same_formats
    dist = result.distribution
    assert dist.num_predictions == NUM_SEGMENTS * (SEGMENT_LEN - PROMPT_LEN - 1)
    split, colocated = dist["split"], dist["colocated"]
    for fmt in (split, colocated):
        assert fmt.kl_max < 1e-6
        assert (fmt.top1_agreement.value, fmt.top1_agreement.low) == (1.0, 1.0)
    assert abs(result.kl_delta.value) < 1e-6 and result.top1_delta.value == 0.0


def test_the_prompt_came_over_the_transfer_and_was_not_recomputed(
    same_formats: tuple[SplitResult, ChunkLog],
) -> None:
    result, log = same_formats
    tally = result.tally
    assert tally.num_handoffs == NUM_SEGMENTS
    assert tally.num_pages == NUM_SEGMENTS * PROMPT_LEN // PAGE_SIZE
    assert tally.prompt_tokens_from_cache == tally.prompt_tokens == NUM_SEGMENTS * PROMPT_LEN
    # The decode engine computed the continuations in chunks from the split point, nothing else.
    per_segment = [(s, min(s + CHUNK, SEGMENT_LEN)) for s in range(PROMPT_LEN, SEGMENT_LEN, CHUNK)]
    assert log.ranges == per_segment * NUM_SEGMENTS


def test_without_the_landed_pages_the_split_refuses_to_score(
    tiny_model_dir: Path, segments: list[list[int]]
) -> None:
    # No prefix cache on the decode side: the landed pages are freed, not kept as blocks, so a
    # scoring request would have to recompute the prompt with decode formats. It must not.
    pair = InProcessPair(
        _engine(tiny_model_dir), _engine(tiny_model_dir, enable_prefix_caching=False)
    )
    try:
        rows = split_logits(pair, segments[0], PROMPT_LEN, CHUNK, "scope-0", HandoffTally())
        with pytest.raises(RuntimeError, match="holds 0 of the 64 prompt tokens"):
            next(rows)
    finally:
        pair.close()
    pair.decode.check_invariants()


def test_fp32_pages_converted_at_landing_equal_fp8_pages_written_locally(
    tiny_model_dir: Path, segments: list[list[int]]
) -> None:
    # Same weights, fp32 KV on prefill, FP8 KV on decode: the landing quantizes each row with a
    # fresh (dynamic) scale exactly as a local FP8 write does, so the split's distributions are
    # the co-located FP8 engine's, to the bit -- and both differ from the fp32-KV reference.
    result, _ = _split_run(tiny_model_dir, segments, {"kv_cache_dtype": "fp8_e4m3"})
    split, colocated = result.distribution["split"], result.distribution["colocated"]
    assert 0 < split.mean_kl.low <= split.mean_kl.high < 0.01
    assert split.top1_agreement.value < 1.0
    assert (split.mean_kl, split.top1_agreement) == (colocated.mean_kl, colocated.top1_agreement)
    assert (result.kl_delta.value, result.top1_delta.value) == (0.0, 0.0)
    assert result.tally.num_bytes == result.tally.num_pages * FP32_PAGE_BYTES  # fp32 on the wire


def test_the_command_writes_its_report(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "split"
    argv = ["eval", "split", "--tokens", "192", "--segment-len", "96", "--resamples", "200"]
    argv += ["--decode", "d:kv_cache_dtype=bfloat16", "--test", "same:", "--out", str(out)]
    argv += ["--model", str(tiny_model_dir), "--num-kv-pages", str(TINY_PAGES)]
    assert main([*argv, "--max-model-len", "1024"]) == 0
    results = json.loads((out / "results.json").read_text())
    labels = [s["label"] for s in results["summary"]]
    assert labels == [
        "base",
        "split base -> d",
        "co-located d",
        "same",
        "split base -> d minus co-located d",
    ]
    assert results["settings"]["prompt_len"] == 48
    assert results["settings"]["decode_prompt_tokens_from_transfer"] == 2 * 48
    assert results["formats"][1]["options"] == {
        "prefill": {"kv_cache_dtype": "auto"},
        "decode": {"kv_cache_dtype": "bfloat16"},
    }
    markdown = (out / "README.md").read_text()
    assert "The split vs its formats co-located" in markdown and "Split point" in markdown
    assert (out / "kl.png").exists()


def test_a_prompt_that_is_not_whole_pages_is_refused_before_loading(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", "split", "--decode", "d:", "--prompt-len", "50", "--model", str(tiny_model_dir)]
    assert main(argv) == 2
    assert "whole pages of 16 tokens" in capsys.readouterr().err
