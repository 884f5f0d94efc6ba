"""One request can never fail another: a poisoned request injected into a running batch, in every
phase of a step, ends alone with an error while every other request's tokens stay identical.

The poison is an exception raised only when the poisoned request takes part (by request id, or by
a token only its prompt holds), so it behaves like a real request-specific fault: the step fails
whenever that request is in it, and succeeds without it. The engine cannot know which request it
is; it must find out (worker/confinement.py).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs

from ..outputs import Collector, Final

POISON_ID = "poison"
POISON_TOKEN = 4242  # only the poisoned prompt holds it (checked against every reference run)
# Detokenization is not the engine's: the front's per-request TextStream does it
# (tests/serve/test_fault_isolation.py poisons it there).
PHASES = ["admission", "prefill", "decode", "sampling", "prefix_indexing"]
MAX_NEW = 10


class Poisoned(RuntimeError):
    """The injected fault."""


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    # Tiny pages and a small step budget: prompts prefill in several chunks, mixed with decodes.
    args = EngineArgs(
        model=str(tiny_model_dir), num_kv_pages=160, page_size=4, max_model_len=128,
        max_num_batched_tokens=24, max_num_seqs=8,
    )  # fmt: skip
    return LLMEngine.from_args(args)


def victims(num: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    cases = []
    for i in range(num):
        prompt = [rng.randrange(300, 20000) for _ in range(rng.randrange(3, 30))]
        if i % 2:  # seeded sampling: its random draws must not move either
            params = SamplingParams(
                temperature=0.9, top_p=0.9, seed=seed + i, max_tokens=MAX_NEW, ignore_eos=True
            )
        else:
            params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        cases.append((prompt, params))
    return cases


def run(
    engine: LLMEngine,
    cases: list[tuple[list[int], SamplingParams]],
    poison_at: int | None = None,
    on_poison_added: Callable[[], None] = lambda: None,
) -> dict[str, Final]:
    """Run the cases (and the poisoned request, added before step `poison_at`) to the end,
    checking the page pool after every step; the final output of each request."""
    engine.kv_manager.reset_prefix_cache()
    ids = [engine.add_request(p, params, request_id=f"v{i}") for i, (p, params) in enumerate(cases)]
    collector = Collector()
    step = 0
    while engine.has_unfinished_requests() or (poison_at is not None and step <= poison_at):
        if step == poison_at:
            prompt = [5000, 6000, POISON_TOKEN, 7000, 8000, 9000, 1000, 2000, 3000]
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW),
                               request_id=POISON_ID)  # fmt: skip
            on_poison_added()
        collector.add(engine.step())
        engine.check_invariants()
        step += 1
        assert step < 500, "the engine did not finish"
    assert set(ids) <= set(collector.finals)
    return collector.finals


@contextlib.contextmanager
def poisoned(engine: LLMEngine, phase: str) -> Iterator[Callable[[], None]]:
    """Install the fault for `phase`; yields what to call once the poisoned request is added."""
    runner, kv = engine.runner, engine.kv_manager
    patches: list[Any] = []
    if phase == "admission":
        patches.append(mock.patch.object(kv, "find_prefix", _raise_for(kv.find_prefix, _req_id)))
    elif phase == "prefill":
        patches.append(mock.patch.object(runner, "model", _PoisonedModel(runner.model)))
    elif phase == "decode":
        patches.append(mock.patch.object(runner, "prepare_inputs", _raise_on_poison_decode(runner)))
    elif phase == "sampling":
        sample = runner.sampler.sample
        patches.append(mock.patch.object(runner.sampler, "sample", _raise_for(sample, _rows_ids)))
    elif phase == "prefix_indexing":
        index = kv.cache_full_pages
        patches.append(mock.patch.object(kv, "cache_full_pages", _raise_for(index, _req_id)))

    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield lambda: None


def _req_id(args: tuple[Any, ...]) -> set[str]:
    return {args[0].request_id}


def _rows_ids(args: tuple[Any, ...]) -> set[str]:
    return {row.request_id for row in args[1]}


def _raise_for(fn: Callable[..., Any], ids_of: Callable[[tuple[Any, ...]], set[str]]) -> Any:
    def wrapper(*args: Any) -> Any:
        if POISON_ID in ids_of(args):
            raise Poisoned(f"{fn.__name__} failure")
        return fn(*args)

    return wrapper


def _raise_on_poison_decode(runner: Any) -> Any:
    prepare = runner.prepare_inputs

    def wrapper(items: list[Any]) -> Any:
        for item in items:
            if item.request_id == POISON_ID and item.start_pos >= len(item.prompt_token_ids):
                raise Poisoned("decode failure")
        return prepare(items)

    return wrapper


class _PoisonedModel:
    """The model, except that a forward over the poisoned prompt token raises (a kernel fault)."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __call__(self, input_ids: Any, *args: Any) -> Any:
        if bool((input_ids == POISON_TOKEN).any()):
            raise Poisoned("forward failure")
        return self._model(input_ids, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


_REFERENCES: dict[tuple[int, int], dict[str, Final]] = {}


def reference_run(engine: LLMEngine, num_victims: int, seed: int) -> dict[str, Final]:
    key = (num_victims, seed)
    if key not in _REFERENCES:
        _REFERENCES[key] = run(engine, victims(num_victims, seed))
    return _REFERENCES[key]


@pytest.mark.parametrize("phase", PHASES)
@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(poison_at=st.integers(0, 4), num_victims=st.integers(1, 4), seed=st.sampled_from([1, 2]))
def test_a_poisoned_request_fails_alone(
    engine: LLMEngine, phase: str, poison_at: int, num_victims: int, seed: int
) -> None:
    cases = victims(num_victims, seed)
    reference = reference_run(engine, num_victims, seed)
    for out in reference.values():
        assert POISON_TOKEN not in (out.token_ids or [])
    with poisoned(engine, phase) as on_added:
        finals = run(engine, cases, poison_at, on_added)
    poison = finals[POISON_ID]
    assert poison.finish_reason == "error", (phase, poison)
    assert poison.error is not None and poison.error.startswith("engine_error")
    for request_id, ref in reference.items():
        assert finals[request_id].finish_reason == ref.finish_reason == "length"
        assert finals[request_id].token_ids == ref.token_ids, (phase, request_id)
    assert engine.kv_manager.num_free_pages == engine.kv_manager.num_pages


def test_a_fault_nobody_causes_alone_fails_only_the_step_it_hits(engine: LLMEngine) -> None:
    """A transient fault (the first forward after admission raises once, whoever is in it) is
    retried without the newest admission, then that one alone: nobody is failed."""
    cases = victims(3, seed=1)
    reference = reference_run(engine, 3, 1)
    failures = iter([True])
    model = engine.runner.model

    def flaky(*args: Any) -> Any:
        if next(failures, False):
            raise Poisoned("transient")
        return model(*args)

    with mock.patch.object(engine.runner, "model", flaky):
        flaky.compute_logits = model.compute_logits  # type: ignore[attr-defined]
        finals = run(engine, cases)
    for request_id, ref in reference.items():
        assert finals[request_id].token_ids == ref.token_ids
        assert finals[request_id].finish_reason == "length"


def test_non_finite_logits_fail_only_their_request(engine: LLMEngine) -> None:
    """NaN logits are not an exception: the sampler itself refuses to pick from them."""
    cases = victims(3, seed=2)
    reference = reference_run(engine, 3, 2)
    compute_logits = engine.runner.model.compute_logits
    poison_rows: list[int] = []

    def nan_for_poison(hidden: Any) -> Any:
        logits = compute_logits(hidden)
        for row in poison_rows:
            logits[row] = float("nan")
        return logits

    prepare = engine.runner.prepare_inputs

    def track(items: list[Any]) -> Any:
        inputs = prepare(items)
        poison_rows[:] = [i for i, s in enumerate(inputs.samplers) if s.request_id == POISON_ID]
        return inputs

    with (
        mock.patch.object(engine.runner.model, "compute_logits", nan_for_poison),
        mock.patch.object(engine.runner, "prepare_inputs", track),
    ):
        finals = run(engine, cases, poison_at=1)
    assert finals[POISON_ID].finish_reason == "error"
    assert (finals[POISON_ID].error or "").startswith("sampling_error")
    for request_id, ref in reference.items():
        assert finals[request_id].token_ids == ref.token_ids
