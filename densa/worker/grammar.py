"""Grammars for constrained decoding: compiled off the engine's step, cached by their spec.

The grammar engine is llguidance (docs/serving.md says why): a `StructuredOutput` (plain text)
becomes an `LLMatcher` over the model's vocabulary. Building a matcher is the expensive part
(about 1-6 ms for an agent's JSON schema on this CPU, up to ~1 s for pathological grammars), so
it runs on a small thread pool -- llguidance releases the GIL while it builds -- and the request
waits outside the scheduler until its grammar is ready (engine/grammar_gate.py). Each compiled
grammar keeps one pristine matcher; a request gets a `deep_copy` of it, which is cheap.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from densa.sampling_params import JSON_STYLE, StructuredOutput
from densa.text.tokenizer import Tokenizer

JSON_OPTIONS: Any = JSON_STYLE  # as llguidance.JsonCompileOptions
DEFAULT_CACHE_ENTRIES = 256
DEFAULT_COMPILE_THREADS = 1  # 2-core machines: one compile beside the engine thread


class GrammarError(ValueError):
    """The constraint cannot be compiled (a grammar error, or a resource limit)."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A ready grammar: a matcher in its initial state, never advanced itself."""

    spec: StructuredOutput
    template: Any  # llguidance.LLMatcher

    def new_matcher(self) -> Any:
        return self.template.deep_copy()


def to_llguidance_grammar(spec: StructuredOutput) -> str:
    """The llguidance grammar text of a constraint."""
    from llguidance import LLMatcher

    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec.spec, defaults=JSON_OPTIONS)
    return LLMatcher.grammar_from_lark(spec.spec)


class GrammarCompiler:
    """Compiles constraints for one tokenizer on a thread pool, with an LRU cache by spec.

    Thread-safe: `submit` may be called from the engine thread while compiles run; a spec that is
    being compiled is not compiled twice (the second caller gets the same future).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_entries: int = DEFAULT_CACHE_ENTRIES,
        num_threads: int = DEFAULT_COMPILE_THREADS,
        limits: Any = None,  # llguidance.LLParserLimits; None = llguidance's defaults
    ) -> None:
        self._limits = limits
        self._tokenizer_json = tokenizer.files.tokenizer_json
        self._eos_token_ids = list(tokenizer.eos_token_ids)
        self.vocab_size = vocab_size
        self._ll_tokenizer: Any = None  # built on first use (~1 s), not at engine start-up
        self._max_entries = max_entries
        self._cache: OrderedDict[StructuredOutput, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="densa-grammar")
        self.num_compiled = 0  # cache misses, for tests and metrics

    def submit(self, spec: StructuredOutput) -> Future[CompiledGrammar]:
        """The compiled grammar of `spec`, now or later. A failed compile is not cached."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None and not _failed(future):
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
            return future

    def compile_now(self, spec: StructuredOutput) -> CompiledGrammar:
        """Block until `spec` is compiled (offline callers and the sampler's fallback)."""
        return self.submit(spec).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutput) -> CompiledGrammar:
        from llguidance import LLMatcher

        tokenizer = self._tokenizer()
        grammar = to_llguidance_grammar(spec)
        matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        _check_can_start(matcher)
        with self._lock:
            self.num_compiled += 1
        return CompiledGrammar(spec, matcher)

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                from llguidance import LLTokenizer

                self._ll_tokenizer = LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos_token_ids
                )
            return self._ll_tokenizer


def _check_can_start(matcher: Any) -> None:
    """A grammar whose language is empty (the regex `[^\\s\\S]`) compiles, then allows no first
    token: found here, on a copy, so the request is refused (400) before it reaches a step. So
    is one whose first step already outgrows the engine's parser limits."""
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    if probe.is_error():
        reason = _first_line(probe.get_error())
        if is_limit_error(reason):
            raise GrammarError(
                f"the output constraint is too complex to follow ({reason}); simplify the schema"
            )
        raise GrammarError(f"the output constraint matches no text at all ({reason})")


# How llguidance words an error of its resource limits (the constraint, not the text, at fault).
_LIMIT = re.compile(r"too complex|limit|too many|max is|max_", re.IGNORECASE)


def is_limit_error(reason: str) -> bool:
    """Whether a grammar engine error says the constraint outgrew the engine's bounds."""
    return _LIMIT.search(reason) is not None


def _failed(future: Future[CompiledGrammar]) -> bool:
    return future.done() and future.exception() is not None


def _first_line(error: str) -> str:
    # llguidance appends its parser state and the whole grammar: keep what a client can act on.
    return error.strip().splitlines()[0] if error.strip() else "invalid grammar"
