"""A constrained request waits outside the scheduler until its grammar is compiled: the engine
keeps stepping everyone else, and the waiting request can be aborted or fail alone."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest

from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams, StructuredOutput
from densa.setup.args import EngineArgs
from densa.worker.grammar import CompiledGrammar, GrammarError

PROMPT = [1, 520, 9531, 198, 27, 1256]
SPEC = StructuredOutput("json_object")


@pytest.fixture
def engine(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[LLMEngine, list[Future]]:
    engine = LLMEngine.from_args(
        EngineArgs(model=str(tiny_model_dir), num_kv_pages=32, max_model_len=256)
    )
    pending: list[Future] = []
    grammars = engine.runner.grammars
    assert grammars is not None

    def slow_submit(spec: StructuredOutput) -> Future:
        """A compile that finishes when the test says so (one future per spec, as cached)."""
        if not pending:
            pending.append(Future())
        return pending[0]

    monkeypatch.setattr(grammars, "submit", slow_submit)
    return engine, pending


def _run(engine: LLMEngine, steps: int) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for _ in range(steps):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_others_run_while_a_grammar_compiles(engine: tuple[LLMEngine, list[Future]]) -> None:
    llm, pending = engine
    waiting = llm.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=8, structured=SPEC))
    plain = llm.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    outputs = _run(llm, 6)
    assert outputs[plain][-1].finished and outputs[plain][-1].num_output_tokens == 4
    assert waiting not in outputs and waiting not in llm.scheduler.requests
    assert llm.has_unfinished_requests() and llm.num_unfinished_requests == 1
    pending[0].set_result(CompiledGrammar(SPEC, _real_template(llm)))
    outputs = _run(llm, 40)
    assert outputs[waiting][-1].finished and outputs[waiting][-1].finish_reason in (
        "stop",
        "length",
    )
    tokens = [t for out in outputs[waiting] for t in out.new_token_ids]
    assert llm.tokenizer.decode(tokens).startswith("{")
    llm.check_invariants()


def test_a_waiting_request_can_be_aborted(engine: tuple[LLMEngine, list[Future]]) -> None:
    llm, pending = engine
    waiting = llm.add_request(PROMPT, SamplingParams(max_tokens=8, structured=SPEC))
    llm.abort_request(waiting)
    [out] = llm.step()
    assert out.request_id == waiting and out.finish_reason == "abort"
    pending[0].set_result(CompiledGrammar(SPEC, _real_template(llm)))  # too late: ignored
    assert not llm.has_unfinished_requests()
    llm.check_invariants()


def test_a_failed_compile_ends_only_that_request(engine: tuple[LLMEngine, list[Future]]) -> None:
    llm, pending = engine
    waiting = llm.add_request(PROMPT, SamplingParams(max_tokens=8, structured=SPEC))
    pending[0].set_exception(GrammarError("the grammar is too large"))
    [out] = llm.step()
    assert out.request_id == waiting and out.finish_reason == "error"
    assert out.error == "invalid_grammar: the grammar is too large"
    assert out.error_code == "invalid_grammar"
    assert not llm.has_unfinished_requests()


def test_fail_all_reaches_waiting_requests(engine: tuple[LLMEngine, list[Future]]) -> None:
    llm, _ = engine
    waiting = llm.add_request(PROMPT, SamplingParams(max_tokens=8, structured=SPEC))
    [out] = llm.fail_all("engine_error: test")
    assert out.request_id == waiting and out.finish_reason == "error"
    assert not llm.has_unfinished_requests()


def _real_template(llm: LLMEngine) -> object:
    from densa.worker.grammar import GrammarCompiler

    compiler = GrammarCompiler(llm.tokenizer, llm.arch.vocab_size)
    return compiler.compile_now(SPEC).template
