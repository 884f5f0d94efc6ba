"""OpenAI Responses bodies (pydantic v2), the stateless subset: the request, the response object,
its output items and its stream events.

Requests are validated like the chat ones (openai/body.py). What needs server-side state --
`previous_response_id`, `store: true`, `conversation`, `background` -- is a 400 that says this
server is stateless; other Responses fields densa cannot honour are a 400 naming them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator

from densa.openai.body import RequestBody as _Body
from densa.openai.fields import INTEGRAL, Unsupported
from densa.openai.tools.models import FUNCTION_NAME

# Said by every refusal of a field that needs stored responses.
STATELESS = (
    "(this server is stateless and keeps no responses: send the whole conversation in input)"
)


# ---- requests: input items ----------------------------------------------------------------------
class InputText(_Body):
    type: Literal["input_text"]
    text: str


class OutputText(_Body):
    """Text of an earlier answer, sent back as part of the conversation."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


TextPart = Annotated[InputText | OutputText, Field(discriminator="type")]


class MessageItem(_Body):
    type: Literal["message"] | None = None  # a bare {"role", "content"} is a message too
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # a label; changes nothing

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else _join(self.content)


class FunctionCallItem(_Body):
    """A call an earlier answer made."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    caller: Annotated[Any, Unsupported("caller (programmatic tool calls)", {"type": "direct"})] = (
        None
    )
    namespace: Annotated[Any, Unsupported("namespace")] = None


class FunctionCallOutputItem(_Body):
    """What the client's function returned for a call."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else _join(self.output)


class ReasoningText(_Body):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Body):
    """An earlier answer's reasoning, sent back as the response gave it: it becomes the next
    assistant message's reasoning_content (templates may show it). `encrypted_content` is another
    server's; densa cannot read it."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] | None = None
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return _join(self.content or [])


def _join(parts: list[Any]) -> str:
    return "\n".join(part.text for part in parts)


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "")
    return kind or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_kind,
        custom_error_type="unsupported_item",
        custom_error_message="input items may be message, function_call, function_call_output "
        "and reasoning items; no other kind is supported",
    ),
]


# ---- requests: tools and the rest ---------------------------------------------------------------
class FunctionTool(_Body):
    """Responses' flat function tool: name and parameters at the top level."""

    type: str
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _function_only(cls, value: str) -> str:
        if value != "function":
            raise ValueError(f"built-in tools ({value}) are not supported; only function tools are")
        return value


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # `schema` shadows a BaseModel attribute in pydantic, hence the alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Annotated[Any, Unsupported("text.verbosity", "medium")] = None


class Reasoning(_Body):
    effort: str | None = None  # passed on as chat's reasoning_effort
    summary: Annotated[Any, Unsupported("reasoning.summary")] = None
    generate_summary: Annotated[Any, Unsupported("reasoning.generate_summary")] = None


class ResponsesRequest(_Body):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)  # echoed back, nothing else
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    store: Annotated[Any, Unsupported(f"store: true {STATELESS}", False)] = None
    previous_response_id: Annotated[Any, Unsupported(f"previous_response_id {STATELESS}")] = None
    conversation: Annotated[Any, Unsupported(f"conversation {STATELESS}")] = None
    background: Annotated[Any, Unsupported(f"background {STATELESS}", False)] = None
    include: Annotated[Any, Unsupported("include", [])] = None
    prompt: Annotated[Any, Unsupported("prompt (stored prompt templates)")] = None
    truncation: Annotated[Any, Unsupported("truncation", "disabled")] = None
    max_tool_calls: Annotated[Any, Unsupported("max_tool_calls")] = None
    top_logprobs: Annotated[Any, Unsupported("top_logprobs", 0)] = None
    service_tier: Annotated[Any, Unsupported("service_tier", "auto", "default")] = None
    stream_options: Annotated[Any, Unsupported("stream_options")] = None
    # densa's, as in chat: false keeps this request out of speculative decoding.
    speculative: bool = True


# ---- responses ----------------------------------------------------------------------------------
class TextOut(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class MessageOut(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[TextOut]


class FunctionCallOut(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningTextOut(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOut(BaseModel):
    """The reasoning the split found (`--reasoning-parser`); always the first item. densa
    returns the reasoning itself, not a summary (nor an encrypted copy)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    status: ItemStatus
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningTextOut]


OutputItem = ReasoningOut | MessageOut | FunctionCallOut


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] | None  # None: the server dropped it while draining


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """A response; its request's settings are echoed back, as OpenAI does."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    store: Literal[False] = False
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None


# ---- stream events (the SSE event name is each body's `type`) ------------------------------------
class Event(BaseModel):
    type: str
    sequence_number: int


class ResponseEvent(Event):
    """response.created / in_progress / completed / incomplete / failed"""

    response: ResponseObject


class OutputItemEvent(Event):
    """response.output_item.added / done"""

    output_index: int
    item: OutputItem


class ItemEvent(Event):
    """An event about one output item (its id and place in `output`)."""

    item_id: str
    output_index: int


class PartEvent(ItemEvent):
    """An event about a content part of an output item (densa writes one part per item)."""

    content_index: int = 0


class ContentPartEvent(PartEvent):
    """response.content_part.added / done"""

    part: TextOut


class TextDeltaEvent(PartEvent):
    type: str = "response.output_text.delta"
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(PartEvent):
    type: str = "response.output_text.done"
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningDeltaEvent(PartEvent):
    type: str = "response.reasoning_text.delta"
    delta: str


class ReasoningDoneEvent(PartEvent):
    type: str = "response.reasoning_text.done"
    text: str


class ArgumentsDeltaEvent(ItemEvent):
    type: str = "response.function_call_arguments.delta"
    delta: str


class ArgumentsDoneEvent(ItemEvent):
    type: str = "response.function_call_arguments.done"
    name: str
    arguments: str
