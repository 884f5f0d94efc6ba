"""Request and response bodies for tools and structured output (OpenAI's shapes, pydantic v2)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from densa.serve.body import RequestBody as _Body

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
