"""MLA latent pages live under the same per-page integrity tags as K/V pages: the faults the tags
catch on a Llama model are caught the same way on DeepSeek-V3's latent cache, and on GLM-5's
(sparse attention), whose index keys share the latents' pages: they are written only into the
pages a request was granted, under the tags it recorded, and released with them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from densa.cache.integrity import ViolationKind
from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams
from tests.outputs import Final
from tests.tiny_families import save_tiny

from .faults import corrupt_next_page_table, release_behind_owner
from .test_engine_faults import assert_only_victim_failed, make_engine, run


@pytest.fixture(scope="module", params=["deepseek_v3", "glm_moe_dsa"])
def mla_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Path:
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param), smollm2_dir)


@pytest.fixture(scope="module")
def mla_clean(mla_model: Path) -> dict[int, Final]:
    return run(make_engine(mla_model))


def test_stale_read_of_a_reused_latent_page(mla_model: Path, mla_clean) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(mla_model)

    def fault(engine: LLMEngine, step: int, ids: list[str]) -> None:
        if step == 3:
            release_behind_owner(engine, ids[0], page_idx=0)

    outputs = run(engine, fault)
    assert_only_victim_failed(outputs, mla_clean, victim=0)
    assert engine.integrity_stats.counts[ViolationKind.STALE_READ] == 1


def test_corrupt_latent_page_table_entry(mla_model: Path, mla_clean) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(mla_model)

    def fault(engine: LLMEngine, step: int, ids: list[str]) -> None:
        if step == 4:
            other_page = engine.scheduler.requests[ids[1]].page_ids[0]
            corrupt_next_page_table(engine, ids[2], page_idx=1, wrong_page=other_page)

    outputs = run(engine, fault)
    assert_only_victim_failed(outputs, mla_clean, victim=2)
    assert engine.integrity_stats.counts[ViolationKind.BAD_MAPPING] == 1


def _index_pages(engine: LLMEngine) -> list[torch.Tensor]:
    """Per full indexer layer: which pages hold any nonzero index key ([num_pages] bool)."""
    caches = [c.index for c in engine.runner.kv_caches if c.index is not None]  # type: ignore[union-attr]
    return [cache.keys.flatten(1).ne(0).any(1) for cache in caches]


def test_index_keys_live_in_the_granted_pages_under_their_tags(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    engine = make_engine(save_tiny("glm_moe_dsa", tmp_path, smollm2_dir))
    pool = engine.kv_manager.pool
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = engine.add_request(list(range(100, 140)), params)  # 40 tokens: 10 pages of 4
    engine.step()  # the whole prompt, one step
    request = engine.scheduler.requests[first]
    pages, tags = list(request.page_ids), list(request.page_tags)
    assert len(pages) == 10 and pool.tags(pages) == tags
    assert engine.runner.integrity.tags[pages].tolist() == tags  # the device mirror agrees
    written = torch.zeros(pool.num_pages, dtype=torch.bool)
    written[pages] = True
    layers = _index_pages(engine)
    assert len(layers) == 2  # layers 0 and 2 run the indexer; 1 and 3 share its choice
    assert all(torch.equal(used, written) for used in layers)

    engine.abort_request(first)  # released: new tags, every page free again
    assert pool.num_free_pages == pool.num_pages
    assert all(new != old for new, old in zip(pool.tags(pages), tags, strict=True))
    second = engine.add_request(list(range(500, 509)), params)
    engine.step()
    reused = engine.scheduler.requests[second]
    assert set(reused.page_ids) <= set(pages)  # the freed pages serve the next request ...
    assert reused.page_tags == pool.tags(reused.page_ids) != [tags[pages.index(p)]
                                                              for p in reused.page_ids]  # fmt: skip
