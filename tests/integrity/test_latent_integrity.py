"""MLA latent pages live under the same per-page integrity tags as K/V pages: the faults the tags
catch on a Llama model are caught the same way on DeepSeek-V3's latent cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from densa.cache.integrity import ViolationKind
from densa.engine.llm_engine import LLMEngine
from tests.outputs import Final
from tests.tiny_families import save_tiny

from .faults import corrupt_next_page_table, release_behind_owner
from .test_engine_faults import assert_only_victim_failed, make_engine, run


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return save_tiny("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"), smollm2_dir)


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
