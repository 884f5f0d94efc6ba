"""Constrained decoding on the engine side: the bitmask kernel against a reference, the grammar
compiler's cache, and generation under JSON schemas with FP8 KV, INT4 weights, the prefix
cache and preemption -- outputs always parse and validate."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from densa.engine.llm import LLM
from densa.kernels.cpu.token_bitmask import apply_token_bitmask_, apply_token_bitmask_ref
from densa.model.quantize import QuantizeSettings, quantize_checkpoint
from densa.quant.weight_format import WeightFormat
from densa.sampling_params import SamplingParams, StructuredOutput
from densa.worker.grammar import GrammarError
from densa_bench.structured.schemas import SCHEMA_CASES

SMALL_CASES = SCHEMA_CASES[:6]


def _spec(schema: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))


def _params(schema: dict, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=400, structured=_spec(schema), **kw)  # type: ignore[arg-type]


def _prompts(llm: LLM, cases: tuple = SMALL_CASES) -> list[str | list[int]]:
    return [llm.tokenizer.encode_chat([{"role": "user", "content": c.prompt}]) for c in cases]


def assert_valid(texts: list[str], cases: tuple = SMALL_CASES) -> None:
    for text, case in zip(texts, cases, strict=True):
        jsonschema.validate(json.loads(text), case.schema)


@pytest.mark.parametrize("vocab", [64, 100, 49152])
def test_bitmask_kernel_matches_the_reference(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    words = -(-vocab // 32)
    bitmask = rng.integers(-(2**31), 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1  # all allowed
    bitmask[1, : words // 2] = 0  # a run of nothing allowed
    logits = torch.randn(5, vocab)
    rows = [0, 2, 4]
    fast, ref = logits.clone(), logits.clone()
    apply_token_bitmask_(fast, bitmask, rows)
    apply_token_bitmask_ref(ref, bitmask, rows)
    assert torch.equal(fast, ref)
    assert torch.equal(fast[[1, 3]], logits[[1, 3]])  # unconstrained rows untouched
    assert torch.equal(fast[0], logits[0])  # an all-ones mask changes nothing
    allowed = [t for t in range(vocab) if (int(bitmask[2, t // 32]) >> (t % 32)) & 1]
    assert torch.isfinite(fast[4]).nonzero().flatten().tolist() == allowed


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), kv_cache_memory="64MiB", max_model_len=1024)


def test_outputs_validate_and_grammars_are_cached(llm: LLM) -> None:
    grammars = llm.engine.runner.grammars
    assert grammars is not None
    results = llm.generate(_prompts(llm), [_params(c.schema) for c in SMALL_CASES])
    assert [r.finish_reason for r in results] == ["stop"] * len(SMALL_CASES)
    assert_valid([r.text for r in results])
    compiled = grammars.num_compiled
    again = llm.generate(_prompts(llm), [_params(c.schema) for c in SMALL_CASES])
    assert grammars.num_compiled == compiled  # every schema came from the cache
    assert [r.token_ids for r in again] == [r.token_ids for r in results]
    structured = llm.engine.runner.sampler.structured
    assert structured is not None
    llm.engine.step()  # the runner hears of finished requests with the next step
    assert structured.num_tracked == 0


def test_a_grammar_that_does_not_compile_fails_only_its_request(llm: LLM) -> None:
    bad = SamplingParams(max_tokens=8, structured=StructuredOutput("lark", "start: undefined_rule"))
    good = _params(SMALL_CASES[0].schema)
    [failed, ok] = llm.generate(_prompts(llm, SMALL_CASES[:2]), [bad, good])
    assert failed.finish_reason == "error"
    assert failed.error is not None and failed.error.startswith("invalid_grammar:")
    assert ok.finish_reason == "stop"
    with pytest.raises(GrammarError):
        llm.engine.runner.grammars.compile_now(bad.structured)  # type: ignore[union-attr, arg-type]
    llm.engine.check_invariants()


def test_json_object_mode_and_sampling(llm: LLM) -> None:
    """Any JSON object: unbounded, so a random model may run to max_tokens; every answer is
    still a JSON object or, if cut short, the beginning of one."""
    params = [
        SamplingParams(
            temperature=0.8, seed=s, max_tokens=64, structured=StructuredOutput("json_object")
        )
        for s in range(4)
    ]
    results = llm.generate(_prompts(llm, SMALL_CASES[:4]), params)
    for r in results:
        assert r.text.startswith("{")
        if r.finish_reason == "stop":
            assert isinstance(json.loads(r.text), dict)
        else:
            assert r.finish_reason == "length"
            with pytest.raises(json.JSONDecodeError):
                json.loads(r.text)


def test_ignore_eos_cannot_be_combined_with_a_constraint() -> None:
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=StructuredOutput("json_object"))


def test_min_tokens_yields_to_a_finished_grammar(llm: LLM) -> None:
    """A grammar that allows only EOS wins over min_tokens (a row of -inf has no token)."""
    schema = {"enum": ["a"]}
    [result] = llm.generate(_prompts(llm, SMALL_CASES[:1]), [_params(schema, min_tokens=50)])
    assert result.finish_reason == "stop"
    assert json.loads(result.text) == "a"


def test_matcher_state_is_rebuilt_from_the_output_tokens(llm: LLM) -> None:
    """Dropping every matcher mid-generation (as a restarted worker would) changes nothing."""
    case = SMALL_CASES[3]
    [expected] = llm.generate(_prompts(llm, (case,)), [_params(case.schema)])
    engine = llm.engine
    request_id = engine.add_request(_prompts(llm, (case,))[0], _params(case.schema))  # type: ignore[arg-type]
    structured = engine.runner.sampler.structured
    assert structured is not None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
        structured.forget(request_id)
    assert tokens == expected.token_ids


@pytest.mark.parametrize(
    "overrides",
    [
        {"kv_cache_dtype": "fp8_e4m3"},
        {"kv_cache_dtype": "bfloat16", "enable_prefix_caching": True},
        {"num_kv_pages": 24, "max_model_len": 256},  # small pool: requests preempt, recompute
    ],
    ids=["fp8-kv", "prefix-cache", "preemption"],
)
def test_constrained_outputs_across_formats(tiny_model_dir: Path, overrides: dict) -> None:
    llm = LLM(
        str(tiny_model_dir), **({"kv_cache_memory": "64MiB", "max_model_len": 1024} | overrides)
    )
    cases = SCHEMA_CASES[6:14]
    prompts = _prompts(llm, cases)
    results = llm.generate(prompts, [_params(c.schema) for c in cases])
    assert [r.finish_reason for r in results] == ["stop"] * len(cases)
    assert_valid([r.text for r in results], cases)
    if "num_kv_pages" in overrides:
        assert llm.engine.scheduler.num_preemptions > 0
        alone = [
            llm.generate([p], [_params(c.schema)])[0] for p, c in zip(prompts, cases, strict=True)
        ]
        assert [r.token_ids for r in results] == [r.token_ids for r in alone]
    if overrides.get("enable_prefix_caching"):
        again = llm.generate(prompts, [_params(c.schema) for c in cases])
        assert all(r.num_cached_tokens > 0 for r in again)
        assert [r.token_ids for r in again] == [r.token_ids for r in results]
    llm.engine.check_invariants()


def test_constrained_outputs_with_int4_weights(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    settings = QuantizeSettings(WeightFormat("int4", group_size=32), show_progress=False)
    out = quantize_checkpoint(str(tiny_model_dir), tmp_path_factory.mktemp("int4"), settings)
    llm = LLM(str(out.output_dir), kv_cache_memory="64MiB", max_model_len=1024)
    cases = SCHEMA_CASES[14:]
    results = llm.generate(_prompts(llm, cases), [_params(c.schema) for c in cases])
    assert [r.finish_reason for r in results] == ["stop"] * len(cases)
    assert_valid([r.text for r in results], cases)
