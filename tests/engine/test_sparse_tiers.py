"""KV tiers carry sparse attention's index keys with the latents of each page: a GLM-5 prefix
evicted from a tiny device pool comes back from the host tier, index keys included, and the
tokens are those of the first run (its indexer reads the fetched keys)."""

from __future__ import annotations

from pathlib import Path

import pytest

from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from tests.outputs import Collector, Final
from tests.tiny_families import save_tiny

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[(13 * i + 7 * k) % 3000 + 300 for i in range(40)] for k in range(2)]


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return save_tiny("glm_moe_dsa", tmp_path_factory.mktemp("glm"), smollm2_dir)


def _run(engine: LLMEngine, prompt: list[int]) -> Final:
    collector = Collector()
    request_id = engine.add_request(prompt, GREEDY)
    while request_id not in collector.finals:
        collector.add(engine.step())
        engine.check_invariants()
    if engine.kv_tiers is not None:
        engine.kv_tiers.flush()
    return collector.finals[request_id]


def test_an_evicted_sparse_prefix_comes_back_with_its_index_keys(glm: Path) -> None:
    # 16 pages of 4 tokens: a 48-token request takes 12, so the second prompt evicts the first.
    engine = LLMEngine.from_args(
        EngineArgs(model=str(glm), num_kv_pages=16, page_size=4, max_model_len=64)
    )
    engine.attach_tiers(("host:16MiB",), None)
    assert engine.kv_tiers is not None and engine.kv_tiers.layout.index is not None
    first, *others = PROMPTS
    original = _run(engine, first)
    for other in others:
        _run(engine, other)
    again = _run(engine, first)
    assert again.num_cached_tokens == 36  # 9 full pages cached; the last token is computed
    assert engine.kv_tiers.num_fetched_pages == 5  # 4 still on the device, 5 from the tier
    assert again.token_ids == original.token_ids
