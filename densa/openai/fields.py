"""Annotated field types of the request bodies: what each accepts, and how it is published.

A before-validator turns what clients may send into one form (a list of text parts into a string,
3.0 into 3); `WithJsonSchema` publishes what is accepted, not the normalized form, so the OpenAPI
schema documents exactly what the server validates.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    WithJsonSchema,
)
from pydantic_core import PydanticCustomError, core_schema

from densa.sampling_params import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_STOP_STRINGS

_IMAGE_PARTS = ("image_url", "image", "input_image")


def _join_text_parts(value: Any) -> Any:
    """Content is a string or a list of {"type": "text", "text": ...} parts (joined by "\\n")."""
    if not isinstance(value, list):
        return value
    texts = []
    for part in value:
        if isinstance(part, dict) and part.get("type") in _IMAGE_PARTS:
            raise ValueError(
                "image content parts are not supported: densa serves text models only (a "
                "multimodal checkpoint such as Kimi K2.5 is served without its vision tower)"
            )
        if not (isinstance(part, dict) and part.get("type") == "text"):
            raise ValueError(
                'only text content parts ({"type": "text", "text": ...}) are supported'
            )
        if not isinstance(part.get("text"), str):
            raise ValueError("a text content part needs a string 'text'")
        texts.append(part["text"])
    return "\n".join(texts)


def _as_stop_list(value: Any) -> Any:
    if value is None:
        return []
    return [value] if isinstance(value, str) else value


def _integral(value: Any) -> Any:
    """JSON has one number type: 3.0 is the integer 3 (as JSON Schema says). 3.5 stays a float and
    fails validation; true stays a bool and fails too."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _single_prompt(value: Any) -> Any:
    """A string or a list of token ids; a batch of exactly one prompt is unwrapped."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        value = [_integral(t) for t in value]
    if isinstance(value, list) and all(type(t) is int for t in value):
        return value
    if isinstance(value, list) and all(isinstance(p, str | list) for p in value):
        raise ValueError("several prompts in one request are not supported; send one per request")
    raise ValueError("prompt must be a string or a list of token ids")


# The published schema (WithJsonSchema) says what the before-validators accept, not what they make.
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_NON_EMPTY = {"type": "string", "minLength": 1}
_STOP_STRING = _NON_EMPTY
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# Integer fields: `Annotated[int, Field(constraints), INTEGRAL]` (constraints first, or pydantic
# cannot publish them in the JSON schema).
INTEGRAL = BeforeValidator(_integral)
Int = Annotated[int, INTEGRAL]
TextContent = Annotated[
    str | None,
    BeforeValidator(_join_text_parts),
    WithJsonSchema(
        {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]}
    ),
]
StopStrings = Annotated[
    list[Annotated[str, Field(min_length=1)]],
    BeforeValidator(_as_stop_list),
    Field(max_length=MAX_STOP_STRINGS),
    WithJsonSchema(
        {
            "anyOf": [
                _STOP_STRING,
                {"type": "array", "items": _STOP_STRING, "maxItems": MAX_STOP_STRINGS},
                {"type": "null"},
            ]
        }
    ),
]
Prompt = Annotated[
    str | list[int],
    BeforeValidator(_single_prompt),
    WithJsonSchema(
        {
            "description": "one prompt: text, token ids, or a list holding exactly one of those",
            "anyOf": [
                _NON_EMPTY,
                _TOKEN_IDS,
                {"type": "array", "items": _NON_EMPTY, "minItems": 1, "maxItems": 1},
                {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 1},
            ],
        }
    ),
]
Role = Literal["system", "user", "assistant", "tool", "developer"]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
# What chat templates are rendered with already; a request cannot replace these.
RESERVED_TEMPLATE_NAMES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
     "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"}
)  # fmt: skip


def _template_names(value: Any) -> Any:
    if isinstance(value, dict):
        for name in value:
            if not (isinstance(name, str) and name.isidentifier()):
                raise ValueError(f"{name!r} is not a template variable name")
            if name in RESERVED_TEMPLATE_NAMES:
                raise ValueError(f"{name!r} is set by the server; it cannot be passed")
    return value


TemplateKwargs = Annotated[dict[str, Any], BeforeValidator(_template_names), Field(max_length=64)]


def _unsupported(accepted: dict[str, Any], feature: str) -> WithJsonSchema:
    """Publish only the values a field is accepted with: the OpenAI field exists, but any other
    value is refused with a 400 rather than silently ignored."""
    schema = {"anyOf": [accepted, {"type": "null"}], "description": f"{feature}: not supported"}
    return WithJsonSchema(schema)


class Unsupported:
    """Marks an OpenAI parameter densa does not implement: `Annotated[Any, Unsupported(...)]`.

    null (or one of `accepted`, values that ask for nothing, e.g. `store: false`) passes; anything
    else is a 400 naming the parameter, never silently ignored.
    """

    def __init__(self, feature: str, *accepted: Any) -> None:
        self.feature = feature
        self.accepted = accepted

    def _check(self, value: Any) -> Any:
        if value is None or any(value == a and type(value) is type(a) for a in self.accepted):
            return value
        message = "{feature} is not supported by this server"
        raise PydanticCustomError("unsupported_parameter", message, {"feature": self.feature})

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> Any:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: Any, handler: GetJsonSchemaHandler) -> Any:
        published = [{"const": a} for a in self.accepted]
        description = f"{self.feature}: not supported"
        return {"anyOf": [*published, {"type": "null"}], "description": description}


OnlyOne = Annotated[Int | None, _unsupported({"const": 1}, "several choices")]
# JSON keys are strings: a token id is spelled in decimal ("50256"), as OpenAI's clients send it.
LogitBias = Annotated[
    dict[
        Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")],
        Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])],
    ],
    Field(max_length=MAX_LOGIT_BIAS),
]
