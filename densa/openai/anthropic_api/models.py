"""Anthropic Messages bodies (pydantic v2): the request, the Message answer, its stream events.

Requests are validated like the OpenAI ones (openai/body.py: strict types, null means unset,
unknown fields refused); a field Anthropic defines that densa cannot honour is a 400 naming it
(`Unsupported`), never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from densa.openai.body import RequestBody as _Body
from densa.openai.fields import INTEGRAL, StopStrings, Unsupported
from densa.openai.tools.models import FUNCTION_NAME
from densa.sampling_params import MAX_COUNT

# "cache_control" marks where Anthropic should cache a prefix; densa caches every prompt prefix
# by itself (docs/kv-cache.md), so the marker is accepted and changes nothing.
CacheControl = dict[str, Any] | None


# ---- requests -----------------------------------------------------------------------------------
class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: Annotated[Any, Unsupported("citations")] = None


class ToolUseBlock(_Body):
    """A call an earlier assistant turn made."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None
    # What the SDK's own ToolUseBlock.model_dump() carries along, null for a client tool's call.
    caller: Annotated[Any, Unsupported("caller (programmatic tool calls)", {"type": "direct"})] = (
        None
    )
    toolset_name: Annotated[Any, Unsupported("toolset_name (MCP toolsets)")] = None


class ToolResultBlock(_Body):
    """What a call returned, sent in the next user turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else _join(self.content)


class ThinkingBlock(_Body):
    """An earlier assistant turn's reasoning, sent back as the answer gave it. Its signature is
    not checked: densa's answers carry an empty one."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Body):
    """Reasoning another server encrypted: densa cannot read it, so the turn goes on without it."""

    type: Literal["redacted_thinking"]
    data: str


InputBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[InputBlock]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> InputMessage:
        if isinstance(self.content, str):
            return self
        kinds = {block.type for block in self.content}
        if self.role == "user" and "tool_use" in kinds:
            raise ValueError("tool_use blocks belong in assistant messages")
        if self.role == "assistant" and "tool_result" in kinds:
            raise ValueError("tool_result blocks belong in user messages")
        if self.role == "user" and kinds & {"thinking", "redacted_thinking"}:
            raise ValueError("thinking blocks belong in assistant messages")
        return self


class ToolSpec(_Body):
    """A client tool (Anthropic's "custom" type): its name, description and input schema."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None
    cache_control: CacheControl = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _client_tool(cls, value: str | None) -> str | None:
        if value not in (None, "custom"):
            raise ValueError(
                f"server tools ({value}) are not supported; only client tools "
                "(name, description, input_schema) are"
            )
        return value


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # the tool, with type "tool"
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('tool_choice names a tool exactly when its type is "tool"')
        return self


class ThinkingConfig(_Body):
    """Extended thinking. "disabled" turns the template's thinking switch off where it has one
    (Qwen3's and GLM's enable_thinking); "enabled" and "adaptive" leave the model to think as its
    template does. The reasoning comes back as `thinking` blocks when the server splits it
    (`--reasoning-parser`). `budget_tokens` is read and not enforced: max_tokens bounds the whole
    answer (the response names it in x-densa-ignored-fields)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None


class Metadata(_Body):
    user_id: str | None = None


class MessagesRequest(_Body):
    model: str
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL]
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: StopStrings = Field(default_factory=list)
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Annotated[int, Field(ge=0, le=MAX_COUNT), INTEGRAL] | None = None
    tools: list[ToolSpec] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    thinking: ThinkingConfig | None = None
    service_tier: Annotated[Any, Unsupported("service_tier", "auto", "standard_only")] = None
    output_config: Annotated[Any, Unsupported("output_config")] = None
    container: Annotated[Any, Unsupported("container (server-side code execution)")] = None
    mcp_servers: Annotated[Any, Unsupported("mcp_servers (remote MCP servers)")] = None
    inference_geo: Annotated[Any, Unsupported("inference_geo")] = None
    speed: Annotated[Any, Unsupported("speed", "standard")] = None
    # densa's, as in chat: false keeps this request out of speculative decoding.
    speculative: bool = True


class CountTokensRequest(_Body):
    """The prompt part of a MessagesRequest: what /v1/messages/count_tokens measures."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolSpec] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


def _join(blocks: list[TextBlock]) -> str:
    return "\n".join(block.text for block in blocks)


# ---- responses ----------------------------------------------------------------------------------
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn"]


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingContent(BaseModel):
    """The reasoning the split found (`--reasoning-parser`); always the first block."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # densa does not sign its reasoning; one sent back is taken as it is


ContentBlock = ThinkingContent | TextContent | ToolUseContent


class MessageUsage(BaseModel):
    """Anthropic counts prompt tokens read from the cache apart from `input_tokens`: the prompt
    is input_tokens + cache_read_input_tokens (densa writes no separate cache entries)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


# ---- stream events (the SSE event name is each body's `type`) ------------------------------------
class MessageStart(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class Ping(BaseModel):
    type: Literal["ping"] = "ping"


class ContentBlockStart(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDelta(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: ThinkingDelta | TextDelta | InputJsonDelta


class ContentBlockStop(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopInfo(BaseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None = None


class MessageDelta(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: StopInfo
    usage: MessageUsage  # cumulative totals


class MessageStop(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class ErrorDetail(BaseModel):
    type: str  # invalid_request_error, authentication_error, ..., api_error, overloaded_error
    message: str


class ErrorBody(BaseModel):
    type: Literal["error"] = "error"
    error: ErrorDetail
