"""A request's stop token ids cost the engine one set, built once: never per step, so one
tenant's long list cannot slow another tenant's decode (the scheduler's stop check and the
sampler both read it after every sampled token)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

from densa import sampling_params
from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from densa.sched import stop
from densa.setup.args import EngineArgs

from ..outputs import Collector

NUM_TOKENS = 24
PROMPT = [300, 1200, 4500, 77, 9100, 640]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine.from_args(EngineArgs(model=str(tiny_model_dir), num_kv_pages=64))


def generate(engine: LLMEngine, params: SamplingParams) -> tuple[list[int], str | None]:
    engine.add_request(PROMPT, params, request_id="r")
    collector = Collector()
    while engine.has_unfinished_requests():
        collector.add(engine.step())
    final = collector.finals["r"]
    return final.token_ids, final.finish_reason


def test_the_stop_set_is_built_once_for_a_whole_generation(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    tokens, _ = generate(engine, greedy)
    stop_at = tokens[NUM_TOKENS // 2]
    # A full list the answer never writes before its middle token, which ends it.
    unused = [t for t in range(40_000, 49_000) if t not in tokens][: MAX_STOP_TOKEN_IDS - 1]
    stop_ids = frozenset([*unused, stop_at])
    builds: list[int] = []

    def counting(items: Iterable[int] = ()) -> frozenset[int]:
        built = frozenset(items)
        builds.extend([1] if built >= stop_ids else [])
        return built

    for module in (sampling_params, stop):
        monkeypatch.setattr(module, "frozenset", counting, raising=False)
    stopping = SamplingParams(
        max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, stop_token_ids=sorted(stop_ids)
    )
    got, reason = generate(engine, stopping)
    assert reason == "stop"
    assert got == tokens[: tokens.index(stop_at) + 1]
    assert len(builds) == 1, f"{len(builds)} stop sets built for {len(got)} tokens"
