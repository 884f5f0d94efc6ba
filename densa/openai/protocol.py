"""OpenAI API bodies (pydantic v2): requests validated field by field, responses and stream chunks.

Requests follow the OpenAI API on its edges: `null` means "the default" for every optional field
(clients send explicit nulls), an unknown field is a 400 naming it (as OpenAI answers
"unrecognized request argument"), and every OpenAI parameter densa does not implement is a 400
naming it unless its value asks for nothing (`store: false`), never silently ignored.
Tool and response-format models live in openai/tools/models.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from densa.openai.body import RequestBody as _RequestBody
from densa.openai.body import publish_nullable as _publish_nullable
from densa.openai.fields import (
    INTEGRAL,
    LogitBias,
    OnlyOne,
    Prompt,
    ReasoningEffort,
    Role,
    StopStrings,
    TemplateKwargs,
    TextContent,
    Unsupported,
)
from densa.openai.tools.models import (
    AssistantToolCall,
    ResponseFormat,
    ResponseToolCall,
    StructuredOutputs,
    ToolCallDelta,
    ToolChoice,
    ToolDefinition,
)
from densa.sampling_params import (
    MAX_COUNT,
    MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    REPETITION_PENALTY_RANGE,
    SamplingParams,
    StructuredOutput,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 16  # n: each choice is an engine request of its own (serve/choices.py)
_DEFAULTS = SamplingParams()  # what an omitted (or null) sampling field means
T = TypeVar("T")


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


# "stop" | "length" | "tool_calls", or "abort" when the server drops a request it could not finish
# while draining.
FinishReason = str


# ---- requests -----------------------------------------------------------------------------------
class StreamOptions(_RequestBody):
    include_usage: bool = False
    include_obfuscation: Annotated[
        Any, Unsupported("stream_options.include_obfuscation", False)
    ] = None


def _publish_message(schema: dict[str, Any], model: type[BaseModel]) -> None:
    # Every role but "assistant" needs non-null content (see _content_present).
    _publish_nullable(schema, model)
    schema["if"] = {"properties": {"role": {"not": {"const": "assistant"}}}}
    schema["then"] = {
        "required": ["content"],
        "properties": {"content": {"not": {"type": "null"}}},
    }


class ChatMessage(_RequestBody):
    model_config = ConfigDict(json_schema_extra=_publish_message)

    role: Role
    content: TextContent = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # calls an earlier assistant turn made
    # An earlier turn's reasoning, as the response gave it (templates may show it again).
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        # Only an assistant turn may omit content (OpenAI: it then carried tool calls instead).
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message can carry tool_calls")
        return self

    def to_template(self) -> dict[str, Any]:
        """The dict the chat template renders. "developer" is OpenAI's new name for "system"."""
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.content or "",
        }
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


class SamplingFields(_RequestBody):
    """Fields shared by chat and completions. None = the default (clients send explicit nulls)."""

    model: str
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES), INTEGRAL] | None = None
    stop: StopStrings = Field(default_factory=list)
    # What torch.Generator accepts.
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64), INTEGRAL] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's spelling of the same idea as x-session-affinity (the header wins when both come).
    prompt_cache_key: str | None = None
    # Who is behind the request, for abuse tracing: written to the request log line.
    safety_identifier: str | None = None
    store: Annotated[Any, Unsupported("store (keeping completions on the server)", False)] = None
    metadata: Annotated[Any, Unsupported("metadata (it tags stored completions)")] = None
    service_tier: Annotated[Any, Unsupported("service_tier", "auto", "default")] = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    user: str | None = None
    logit_bias: LogitBias | None = None  # {"token id": bias in [-100, 100]}
    # Extensions (vLLM spells them the same way).
    top_k: Annotated[int, Field(ge=-1, le=MAX_COUNT), INTEGRAL] | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(
        None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1]
    )
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=MAX_COUNT), INTEGRAL] = 0
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_COUNT), INTEGRAL]] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS
    )
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(None, min_length=1)
    # vLLM's: the answer matches a regex or is one of a list of strings (tools/plan.py).
    structured_outputs: StructuredOutputs | None = None
    # densa's: false keeps this request out of speculative decoding (docs/speculative.md).
    speculative: bool = True

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def to_sampling_params(
        self, max_tokens: int, logprobs: int | None, structured: StructuredOutput | None = None
    ) -> SamplingParams:
        """Raises ValueError (naming the field) for what the field constraints cannot check."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_or(self.temperature, _DEFAULTS.temperature),
            top_p=_or(self.top_p, _DEFAULTS.top_p),
            top_k=_or(self.top_k, _DEFAULTS.top_k),
            min_p=_or(self.min_p, _DEFAULTS.min_p),
            seed=self.seed,
            stop=tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            repetition_penalty=_or(self.repetition_penalty, _DEFAULTS.repetition_penalty),
            presence_penalty=_or(self.presence_penalty, _DEFAULTS.presence_penalty),
            frequency_penalty=_or(self.frequency_penalty, _DEFAULTS.frequency_penalty),
            logprobs=logprobs,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            structured=structured,
            logit_bias=tuple((int(t), b) for t, b in (self.logit_bias or {}).items()),
            speculative=self.speculative,
        )


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    functions: Annotated[Any, Unsupported("functions (the deprecated form of tools)")] = None
    function_call: Annotated[
        Any, Unsupported("function_call (the deprecated form of tool_choice)", "none")
    ] = None
    modalities: Annotated[Any, Unsupported("modalities other than text", ["text"])] = None
    audio: Annotated[Any, Unsupported("audio output")] = None
    prediction: Annotated[Any, Unsupported("prediction (predicted outputs)")] = None
    web_search_options: Annotated[Any, Unsupported("web_search_options (web search)")] = None
    # Given to the chat template where it reads it (openai/templates.py), else ignored.
    reasoning_effort: ReasoningEffort | None = None
    # Extra variables for the chat template (vLLM's name), e.g. {"enable_thinking": false}.
    chat_template_kwargs: TemplateKwargs | None = None
    verbosity: Annotated[Any, Unsupported("verbosity")] = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top-N alternatives per token for the engine; None = no logprobs at all."""
        return (self.top_logprobs or 0) if self.logprobs else None


def _publish_completion(schema: dict[str, Any], model: type[BaseModel]) -> None:
    # max_tokens=0 only with echo (see _echo_rules).
    _publish_nullable(schema, model)
    schema["if"] = {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]}
    schema["then"] = {"properties": {"echo": {"const": True}}, "required": ["echo"]}


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra=_publish_completion)

    prompt: Prompt
    # 0 only with echo: the prompt is scored, nothing is generated (lm-evaluation-harness).
    max_tokens: Annotated[int, Field(ge=0), INTEGRAL] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    # The prompt comes back before the completion, with its tokens' logprobs when `logprobs` is
    # set (SamplingParams.prompt_logprobs; the first token's is null).
    echo: bool = False
    # Fill-in-the-middle: the completion is what goes between the prompt and this text, written
    # with the model's FIM tokens (openai/fim.py); a 400 for a model that has none.
    suffix: str | None = None
    best_of: OnlyOne = None

    @model_validator(mode="after")
    def _echo_rules(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 generates nothing: it is accepted only with echo=true")
        if self.echo and self.suffix is not None:
            raise ValueError("echo cannot be combined with suffix")
        if self.suffix is not None and not isinstance(self.prompt, str):
            raise ValueError("a suffix needs a text prompt (the code before the middle)")
        return self

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens=0: the prompt is scored, nothing is generated."""
        return self.max_tokens == 0

    @property
    def num_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: top-N per prompt token when echoed with logprobs."""
        return self.logprobs if self.echo else None

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return value

    @property
    def requested_max_tokens(self) -> int:
        return DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


# ---- responses ----------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's UTF-8 bytes; a token may hold part of a character


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the answer is only tool calls
    tool_calls: list[ResponseToolCall] | None = None
    reasoning_content: str | None = None  # the thinking of a reasoning model (--reasoning-parser)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # streamed before the content (--reasoning-parser)
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only on the extra final chunk (stream_options.include_usage)


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token of the text (with
    echo, the prompt's tokens first: the first has no logprob, null)."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []  # where each token's text starts in the choice's text


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    """The whole completion, and also each stream chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "densa"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
