"""Request and response bodies for tools and structured output (OpenAI's shapes, pydantic v2)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from densa.openai.body import RequestBody as _Body

# OpenAI's rule for function names.
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


# ---- requests -----------------------------------------------------------------------------------
class FunctionDefinition(_Body):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None = no arguments
    strict: bool | None = None


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# Bounds on what one request may ask the grammar engine to compile.
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` field: the answer matches a regular expression (the grammar
    engine's syntax: Rust's `regex`) or is exactly one of the choices. JSON goes through
    `response_format`; vLLM's other keys here (json, grammar, ...) are ignored like any unknown
    field, and then neither regex nor choice is set: a 400."""

    regex: str | None = Field(None, min_length=1, max_length=MAX_REGEX_CHARS)
    choice: list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]] | None = Field(
        None, min_length=1, max_length=MAX_CHOICES
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        if (self.regex is None) == (self.choice is None):
            raise ValueError("structured_outputs needs exactly one of regex and choice")
        return self


class JsonSchemaFormat(_Body):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    # `schema` shadows a BaseModel attribute in pydantic, hence the alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as the model wrote it


class AssistantToolCall(_Body):
    """A call an assistant turn made, sent back in the conversation history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    @field_validator("function")
    @classmethod
    def _arguments_are_json(cls, value: FunctionCall) -> FunctionCall:
        if not isinstance(_json_or_none(value.arguments), dict):
            raise ValueError("function.arguments must be a JSON object in a string")
        return value


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


# ---- responses ----------------------------------------------------------------------------------
class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """One streamed piece of a call: first its index, id and name, then argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta
