"""llama.cpp's `/infill` (what editor plugins such as llama.vim and llama.vscode call): its request
body, the subset densa reads, and its response, in llama.cpp's own shape (not OpenAI's).

The prompt is laid out from the model's FIM tokens as llama.cpp lays it out (openai/fim.py).
Sampling defaults are llama.cpp's (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), so a
plugin tuned against llama-server samples the same way; `n_predict` (or `max_tokens`) -1 or
absent runs to the end of the context, and 0 only computes the prompt (into the prefix cache),
as there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, Field

from densa.openai import fim
from densa.openai.body import RequestBody
from densa.openai.fields import INTEGRAL, StopStrings
from densa.openai.responses import Generation
from densa.sampling_params import MAX_COUNT, REPETITION_PENALTY_RANGE, SamplingParams
from densa.text.output import RequestOutput

MAX_EXTRA_CHUNKS = 1024  # input_extra entries (llama.vim sends a few dozen)
# llama.cpp's sampling defaults (common/common.h, common_params_sampling).
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.95
DEFAULT_MIN_P = 0.05


class InfillChunk(RequestBody):
    """A file of the project for context: `{"filename": ..., "text": ...}`."""

    text: str
    filename: str = fim.EXTRA_FILE_NAME


class InfillRequest(RequestBody):
    # llama-server serves one model and needs no name; densa checks one that is sent.
    model: str | None = None
    input_prefix: str
    input_suffix: str
    input_extra: list[InfillChunk] = Field(default_factory=list, max_length=MAX_EXTRA_CHUNKS)
    prompt: str = ""  # written after the prefix; it may hold special tokens
    n_predict: Annotated[int, Field(ge=-1, le=MAX_COUNT), INTEGRAL] | None = None
    max_tokens: Annotated[int, Field(ge=-1, le=MAX_COUNT), INTEGRAL] | None = None  # its alias
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_k: Annotated[int, Field(ge=0, le=MAX_COUNT), INTEGRAL] | None = None
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    # llama.cpp's -1 (its default) draws a random seed.
    seed: Annotated[int, Field(ge=-1, lt=2**64), INTEGRAL] | None = None
    stop: StopStrings = Field(default_factory=list)
    stream: bool = False
    repeat_penalty: float | None = Field(
        None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1]
    )
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # densa's prefix cache always reuses a cached prompt; false changes nothing.
    cache_prompt: bool = True

    num_choices: ClassVar[int] = 1  # what serve/pipeline.respond reads
    include_usage: ClassVar[bool] = False

    @property
    def requested_max_tokens(self) -> int | None:
        """None: up to the end of the context (llama.cpp's -1). 0: the prompt only, into the
        prefix cache (editors warm it so)."""
        value = self.n_predict if self.n_predict is not None else self.max_tokens
        return None if value is None or value < 0 else value

    @property
    def extra(self) -> list[fim.ExtraChunk]:
        return [fim.ExtraChunk(c.text, c.filename) for c in self.input_extra]

    def to_sampling_params(
        self, max_tokens: int, stop_token_ids: tuple[int, ...]
    ) -> SamplingParams:
        """Raises ValueError for what the field constraints cannot check."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_or(self.temperature, DEFAULT_TEMPERATURE),
            top_k=DEFAULT_TOP_K if self.top_k is None else self.top_k,
            top_p=_or(self.top_p, DEFAULT_TOP_P),
            min_p=_or(self.min_p, DEFAULT_MIN_P),
            seed=None if self.seed is None or self.seed < 0 else self.seed,
            stop=tuple(self.stop),
            stop_token_ids=stop_token_ids,
            repetition_penalty=_or(self.repeat_penalty, 1.0),
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
        )


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


StopType = Literal["eos", "word", "limit", "none"]


class InfillResponse(BaseModel):
    """The whole answer, and the last stream event (`stop: true`): llama.cpp's fields."""

    index: int = 0
    content: str
    tokens: list[int] = []  # llama.cpp fills it only with return_tokens
    stop: bool = True
    model: str
    tokens_predicted: int  # generated tokens
    tokens_evaluated: int  # prompt tokens
    tokens_cached: int  # prompt tokens found in the prefix cache
    truncated: bool  # leading input_extra tokens were left out to fit the context
    stop_type: StopType  # eos: an end token, word: a stop string, limit: n_predict or context
    stopping_word: str


class InfillChunkResponse(BaseModel):
    """A stream event before the last."""

    index: int = 0
    content: str
    tokens: list[int] = []
    stop: bool = False
    tokens_predicted: int
    tokens_evaluated: int


_STOP_TYPES: dict[str | None, StopType] = {"stop": "eos", "length": "limit"}


def _stop_type(output: RequestOutput) -> StopType:
    if output.stop_string is not None:
        return "word"
    return _STOP_TYPES.get(output.finish_reason, "none")


@dataclass
class InfillFormatter:
    """Engine outputs -> llama.cpp's /infill bodies and stream events."""

    model: str
    truncated: bool

    def response(self, generation: Generation) -> InfillResponse:
        return self._final(generation.text, generation.final)

    def stream_start(self) -> list[BaseModel]:
        return []

    def stream_chunks(self, output: RequestOutput) -> list[BaseModel]:
        if output.finished:
            return [self._final(output.new_text, output)]
        if not output.new_text:
            return []
        chunk = InfillChunkResponse(
            content=output.new_text,
            tokens_predicted=output.num_output_tokens,
            tokens_evaluated=output.num_prompt_tokens,
        )
        return [chunk]

    def usage_chunk(self, final: RequestOutput) -> BaseModel:
        return self._final("", final)  # never asked for: /infill has no stream_options

    def _final(self, content: str, final: RequestOutput) -> InfillResponse:
        return InfillResponse(
            content=content,
            model=self.model,
            tokens_predicted=final.num_output_tokens,
            tokens_evaluated=final.num_prompt_tokens,
            tokens_cached=final.num_cached_tokens,
            truncated=self.truncated,
            stop_type=_stop_type(final),
            stopping_word=final.stop_string or "",
        )
