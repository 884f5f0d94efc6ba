"""L1: how one request wants its tokens chosen and when it stops. Validated on construction."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

MAX_STOP_STRINGS = 16  # a request may not make the engine scan for an unbounded number of strings
# Nor hold an unbounded stop set: it crosses to the engine with the request, and below min_tokens
# the sampler masks every one of its ids each step.
MAX_STOP_TOKEN_IDS = 16
# The engine's own bound: a client's ids plus those the server adds (fill-in-the-middle's file
# and repository separators), so a client within its bound is never refused for the server's.
MAX_ENGINE_STOP_TOKEN_IDS = 2 * MAX_STOP_TOKEN_IDS
MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
# Below this temperature sampling is greedy: it is the limit of sampling as the temperature falls,
# and dividing logits by a smaller number overflows float32 (1e-45 turned every logit into inf).
GREEDY_BELOW_TEMPERATURE = 1e-5
# Counts (tokens, top-k) beyond this are nonsense for any model; capping them keeps every value a
# 32-bit integer wherever it travels (messages between processes, tensors).
MAX_COUNT = 2**31 - 1
# Repetition penalties outside this range overflow or flush the penalized logits to zero/inf.
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token, 100 all but forces it
MAX_LOGIT_BIAS = 1024  # biased tokens per request

# How constrained JSON is written: as json.dumps writes it, the separators a model has seen most,
# and no free whitespace (a model may otherwise emit newlines forever without breaking the
# grammar). llguidance reads these from a schema's "x-guidance" key, also inside Lark `%json`.
JSON_STYLE: dict[str, object] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

StructuredKind = Literal["json_object", "json_schema", "lark"]
STRUCTURED_KINDS: tuple[StructuredKind, ...] = ("json_object", "json_schema", "lark")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on what the request may generate, as plain text so it crosses a process
    boundary as data; the engine compiles it into a token grammar (worker/grammar.py).

    json_object: any JSON object (spec is empty). json_schema: spec is the schema as JSON text.
    lark: spec is a Lark grammar (llguidance's dialect; `%json {...}` embeds a JSON schema), which
    the HTTP front builds for tool calls wrapped in a model's own markers.
    """

    kind: StructuredKind
    spec: str = ""

    def __post_init__(self) -> None:
        _check(
            self.kind in STRUCTURED_KINDS,
            f"structured output kind must be one of "
            f"{', '.join(STRUCTURED_KINDS)}, got {self.kind!r}",
        )
        _check(
            bool(self.spec) or self.kind == "json_object", f"a {self.kind} constraint needs a spec"
        )


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None  # same seed + same prompt -> same tokens, whatever else is in the batch
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    repetition_penalty: float = (
        1.0  # > 1 discourages any token seen in prompt or output (CTRL-style)
    )
    presence_penalty: float = 0.0  # OpenAI: flat penalty for tokens already generated
    frequency_penalty: float = 0.0  # OpenAI: penalty proportional to the count in the output
    logprobs: int | None = None  # top-N logprobs per generated token (0 = only the chosen token's)
    # Top-N logprobs of every prompt token after the first (vLLM's name; None = none): computed
    # from the prompt's rows in the prefill that runs anyway, so the prompt is never mapped from
    # the prefix cache, whose pages hold K/V but no logits (docs/serving.md, echo).
    prompt_logprobs: int | None = None
    min_tokens: int = 0  # EOS / stop token ids are masked until this many tokens are generated
    skip_special_tokens: bool = True
    # Special tokens written into the text even so: tool-call markers that are special tokens
    # (Mistral's [TOOL_CALLS]), which the call parser must see.
    kept_special_token_ids: tuple[int, ...] = ()
    # Grammar-constrained decoding (JSON schema, tool calls); None = unconstrained.
    structured: StructuredOutput | None = None
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # False: this request never speculates, even when the engine does (docs/speculative.md).
    speculative: bool = True

    def __post_init__(self) -> None:
        # Accept lists from callers; store tuples so the object stays hashable and immutable.
        object.__setattr__(self, "stop", _as_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids))
        object.__setattr__(self, "kept_special_token_ids", _as_tuple(self.kept_special_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        self._validate()

    def _validate(self) -> None:
        _check(1 <= self.max_tokens <= MAX_COUNT, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(
            0.0 <= self.temperature <= 2.0, f"temperature must be in [0, 2], got {self.temperature}"
        )
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(
            -1 <= self.top_k <= MAX_COUNT,
            f"top_k must be -1, 0 (off) or positive, got {self.top_k}",
        )
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        _check(
            low <= self.repetition_penalty <= high,
            f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty}",
        )
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]")
        _check(0 <= self.min_tokens <= MAX_COUNT, f"min_tokens must be in [0, {MAX_COUNT}]")
        _check(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty")
        _check(
            len(self.stop_token_ids) <= MAX_ENGINE_STOP_TOKEN_IDS,
            f"at most {MAX_ENGINE_STOP_TOKEN_IDS} stop_token_ids",
        )
        _check(all(0 <= t <= MAX_COUNT for t in self.stop_token_ids), "stop_token_ids must be >= 0")
        if self.logprobs is not None:
            _check(0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None:
            _check(
                0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]",
            )
        self._validate_logit_bias()
        if self.structured is not None:
            # A finished grammar allows only EOS: ignoring it would force an invalid token.
            _check(not self.ignore_eos, "ignore_eos cannot be combined with a structured output")

    def _validate_logit_bias(self) -> None:
        low, high = LOGIT_BIAS_RANGE
        _check(
            len(self.logit_bias) <= MAX_LOGIT_BIAS, f"at most {MAX_LOGIT_BIAS} logit_bias entries"
        )
        _check(
            all(0 <= t <= MAX_COUNT for t, _ in self.logit_bias),
            "logit_bias token ids must be >= 0",
        )
        _check(
            all(low <= b <= high for _, b in self.logit_bias),
            f"logit_bias values must be in [{low:g}, {high:g}]",
        )

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """stop_token_ids as a set, built once per request: the stop rule reads it after every
        sampled token (sched/stop.py)."""
        return frozenset(self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _as_tuple(value: object) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (str, int)) or not isinstance(value, Iterable):
        return (value,)
    return tuple(value)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
