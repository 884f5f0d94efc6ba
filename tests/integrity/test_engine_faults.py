"""Injected KV bookkeeping faults on a real engine: each is caught, only the affected request is
aborted (with kv_integrity_violation), the others' tokens are unchanged, and the pool recovers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from densa.cache.integrity import ViolationKind
from densa.disagg import wire
from densa.disagg.ports import Landing
from densa.engine.disagg_port import DecodePort
from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs

from ..outputs import Collector, Final
from .faults import corrupt_next_page_table, release_behind_owner

PROMPTS = [list(range(100, 111)), list(range(200, 207)), list(range(300, 318))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
Fault = Callable[[LLMEngine, int, list[str]], None]


def make_engine(model_dir: Path, integrity: bool = True) -> LLMEngine:
    args = EngineArgs(
        model=str(model_dir),
        num_kv_pages=48,
        page_size=4,
        max_model_len=128,
        enable_prefix_caching=False,
        kv_integrity=integrity,
    )
    return LLMEngine.from_args(args)


def run(engine: LLMEngine, fault: Fault | None = None, extra_at: int = 3) -> dict[int, Final]:
    """Run PROMPTS (+ one late arrival) to completion; `fault(engine, step, ids)` runs before each step."""
    ids = [engine.add_request(p, PARAMS) for p in PROMPTS]
    collector = Collector()
    step = 0
    while engine.has_unfinished_requests() or step <= extra_at:
        if step == extra_at:
            ids.append(engine.add_request(list(range(400, 409)), PARAMS))
        if fault is not None:
            fault(engine, step, ids)
        collector.add(engine.step())
        step += 1
    engine.check_invariants()  # every page free again, ref counts consistent
    return {i: collector.finals[rid] for i, rid in enumerate(ids)}


@pytest.fixture(scope="module")
def clean(tiny_model_dir: Path) -> dict[int, Final]:
    return run(make_engine(tiny_model_dir))


def assert_only_victim_failed(
    outputs: dict[int, Final], clean: dict[int, Final], victim: int
) -> None:
    assert outputs[victim].finish_reason == "error"
    assert outputs[victim].error_code == "kv_integrity_violation"
    for idx, out in outputs.items():
        if idx != victim:
            assert out.error is None and out.token_ids == clean[idx].token_ids, idx


def test_page_released_and_reused_while_mapped_is_a_stale_read(tiny_model_dir: Path, clean) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_model_dir)

    def fault(engine: LLMEngine, step: int, ids: list[str]) -> None:
        if step == 3:  # before the late arrival is admitted: it will receive the page
            release_behind_owner(engine, ids[0], page_idx=0)

    outputs = run(engine, fault)
    assert_only_victim_failed(outputs, clean, victim=0)
    assert engine.integrity_stats.counts[ViolationKind.STALE_READ] == 1


def test_page_being_written_released_behind_its_owner_is_a_stale_write(
    tiny_model_dir: Path, clean
) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_model_dir)

    def fault(engine: LLMEngine, step: int, ids: list[str]) -> None:
        if step == 5:
            request = engine.scheduler.requests[ids[1]]
            release_behind_owner(engine, ids[1], page_idx=request.num_computed_tokens // 4)

    outputs = run(engine, fault)
    assert_only_victim_failed(outputs, clean, victim=1)
    assert engine.integrity_stats.counts[ViolationKind.STALE_WRITE] == 1


def test_corrupt_page_table_entry_is_a_bad_mapping(tiny_model_dir: Path, clean) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_model_dir)

    def fault(engine: LLMEngine, step: int, ids: list[str]) -> None:
        if step == 4:
            other_page = engine.scheduler.requests[ids[1]].page_ids[0]
            corrupt_next_page_table(engine, ids[2], page_idx=1, wrong_page=other_page)

    outputs = run(engine, fault)
    assert_only_victim_failed(outputs, clean, victim=2)
    assert engine.integrity_stats.counts[ViolationKind.BAD_MAPPING] == 1


def test_late_write_to_a_reallocated_page_is_dropped(tiny_model_dir: Path, clean) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_model_dir)
    stale: list[tuple[str, int, int]] = []  # (request id, page, tag) of the in-flight transfer

    def fault(engine: LLMEngine, step: int, ids: list[str]) -> None:
        if step == 2:  # a transfer for request 0 is in flight when request 0 is aborted
            request = engine.scheduler.requests[ids[0]]
            stale.append((ids[0], request.page_ids[0], request.page_tags[0]))
            engine.abort_request(ids[0])
            engine.kv_manager.pool.move_to_front(stale[0][1])  # reused next
        if step == 4:  # ...by now the late arrival owns that page; the transfer lands late
            rid, page, tag = stale[0]
            owner = [r for r in engine.scheduler.requests.values() if page in r.page_ids]
            assert owner, "the released page should have been reused"
            # Any bytes of one page: the landing must be refused before a step could write them.
            packed = wire.pack_pages(engine.runner.kv_caches, [page])
            landing = Landing([page], [tag], packed.layout, packed.frames, 7, None, 0)
            refused = DecodePort(engine).land_remote(rid, landing)
            assert refused is not None and "stale_write" in refused
            assert not engine.scheduler.remote.has_landings  # nothing queued for the next step

    outputs = run(engine, fault)
    assert outputs[0].finish_reason == "abort"
    for idx in (1, 2, 3):
        assert outputs[idx].token_ids == clean[idx].token_ids
    assert engine.integrity_stats.counts[ViolationKind.STALE_WRITE] == 1


def test_double_release_is_refused_and_reported(tiny_model_dir: Path, clean) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_model_dir)

    def fault(engine: LLMEngine, step: int, ids: list[str]) -> None:
        if step == 2:
            request = engine.scheduler.requests[ids[0]]
            pages, tags = list(request.page_ids), list(request.page_tags)
            engine.abort_request(ids[0])
            problems = engine.kv_manager.release(ids[0], pages, tags)  # released a second time
            assert [p.kind for p in problems] == [ViolationKind.DOUBLE_FREE] * len(pages)

    outputs = run(engine, fault)
    for idx in (1, 2, 3):
        assert outputs[idx].token_ids == clean[idx].token_ids


def test_integrity_off_runs_the_same_tokens(tiny_model_dir: Path, clean) -> None:  # type: ignore[no-untyped-def]
    outputs = run(make_engine(tiny_model_dir, integrity=False))
    assert {i: o.token_ids for i, o in outputs.items()} == {
        i: o.token_ids for i, o in clean.items()
    }
