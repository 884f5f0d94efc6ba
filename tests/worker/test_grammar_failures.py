"""A constraint that cannot proceed ends its request with a reason: a 4xx code (invalid_grammar)
when the request's own constraint outgrew the grammar engine's bounds, else grammar_error (a
server fault) -- here the real case that made every forced Qwen2.5 call fail."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from densa.model.loader import resolve_model_dir
from densa.openai.tools.formats import HERMES
from densa.sampling_params import StructuredOutput
from densa.text.tokenizer import Tokenizer
from densa.worker.grammar import GrammarCompiler, GrammarError
from densa.worker.structured import StructuredRow, StructuredSampler

TOOL = {"type": "function", "function": {"name": "ping"}}


def _allowed(bitmask: object, vocab_size: int) -> list[int]:
    import numpy as np

    bits = np.unpackbits(np.asarray(bitmask).view(np.uint8), bitorder="little")
    return np.nonzero(bits[:vocab_size])[0].tolist()


def test_a_token_the_mask_allowed_but_the_engine_refuses_is_a_grammar_error(
    real_model: Callable[[str], Path],
) -> None:
    """Qwen2.5's `<tool_call>` is one token; a grammar spelling it as text allows that token in
    its mask, then refuses it (llguidance 1.9.1). The request ends, naming the token."""
    tokenizer = Tokenizer.from_dir(resolve_model_dir(str(real_model("qwen2.5-coder-0.5b"))))
    vocab_size = 151936
    sampler = StructuredSampler(GrammarCompiler(tokenizer, vocab_size))
    row = StructuredRow(0, "req-1", HERMES.call_grammar([TOOL], parallel=False), [])
    assert _allowed(sampler.fill_bitmask([row], 1), vocab_size) == [151657]
    errors = sampler.accept([row], [151657])
    assert errors["req-1"].startswith(
        "grammar_error: the grammar engine refused token 151657, which its own mask allowed ("
    )
    assert "doesn't satisfy the grammar" in errors["req-1"]
    sampler.compiler.shutdown()


def test_a_constraint_beyond_the_engines_bounds_is_the_requests_fault(smollm2_dir: Path) -> None:
    from llguidance import LLParserLimits

    tokenizer = Tokenizer.from_dir(smollm2_dir)
    compiler = GrammarCompiler(
        tokenizer, tokenizer.vocab_size, limits=LLParserLimits(step_max_items=3)
    )
    schema = {"type": "object", "properties": {"b": {"type": "array", "items": {"type": "number"}}}}
    # Its first step already outgrows the limits: refused when it compiles (a 400
    # invalid_grammar before the request is scheduled), named as too complex, not as empty.
    with pytest.raises(GrammarError, match="too complex to follow") as info:
        compiler.compile_now(StructuredOutput("json_schema", json.dumps(schema)))
    assert "Too many items" in str(info.value) and str(info.value).endswith("simplify the schema")
    compiler.shutdown()


def test_a_token_sampled_outside_the_mask_says_nothing_was_allowed(smollm2_dir: Path) -> None:
    """All the tokens a constraint allows can be out of reach (their logits -inf): what is
    sampled then lies outside the mask, and the request ends saying so."""
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    sampler = StructuredSampler(compiler)
    row = StructuredRow(0, "req-3", StructuredOutput("json_schema", '{"const": "x"}'), [])
    outside = tokenizer.encode("hello", add_special_tokens=False)[0]
    assert outside not in _allowed(sampler.fill_bitmask([row], 1), tokenizer.vocab_size)
    errors = sampler.accept([row], [outside])
    assert errors["req-3"] == (
        "grammar_error: the output constraint allows no token the model can write here "
        f"(token {outside} was sampled from nothing)"
    )
    compiler.shutdown()
