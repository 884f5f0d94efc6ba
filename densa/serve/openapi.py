"""The published OpenAPI schema: the request models the routes validate by hand, the limits
that depend on the served model, and the response shapes every generation route shares."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from densa.openai.anthropic_api.models import CountTokensRequest, MessagesRequest
from densa.openai.errors import ErrorResponse
from densa.openai.infill import InfillRequest
from densa.openai.protocol import ChatCompletionRequest, CompletionRequest
from densa.openai.responses_api.models import ResponsesRequest
from densa.serve import tokenize as tokenization
from densa.serve.state import ServerState

# Request bodies are read by hand (size limit, UTF-8 and JSON errors, strict types), so FastAPI does
# not see their models: the schema gets them from here, exactly the models the routes validate with.
REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    MessagesRequest,
    CountTokensRequest,
    ResponsesRequest,
    InfillRequest,
    *tokenization.REQUEST_MODELS,
)


_REF = "#/components/schemas/{model}"


def request_body(*models: type[BaseModel]) -> dict[str, Any]:
    """One of `models` (by reference to the published component)."""
    refs = [{"$ref": _REF.format(model=model.__name__)} for model in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def ok_or_events(model: type[BaseModel]) -> dict[str, Any]:
    """A 200 that is JSON (`model`) or, with "stream": true, server-sent events. Before OpenAPI
    3.2 (no `itemSchema`), a text/event-stream `schema` describes each event: its `data` is one
    JSON chunk (or `[DONE]`)."""
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"type": "string"},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
    }
    events = {"schema": event}
    return {"model": model, "content": {"text/event-stream": events}}


# Statuses every generation endpoint may answer with, besides 200.
GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 413, 429, 500, 503, 504)
}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title,
            version=app.version,
            description="OpenAI-compatible API served by densa (docs/serving.md).",
            routes=app.routes,
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in REQUEST_MODELS:
            model_schema = model.model_json_schema(ref_template=_REF)
            defs = model_schema.pop("$defs", {})
            required = "model" in model_schema.get("required", [])
            _publish_limits(model_schema["properties"], app.state.densa, required)
            if not app.state.densa.api.strict_api:  # unknown fields are accepted (and dropped)
                for part in (model_schema, *defs.values()):
                    if part.get("additionalProperties") is False:
                        del part["additionalProperties"]
            components.update(defs)
            components[model.__name__] = model_schema
        app.openapi_schema = schema
    return app.openapi_schema


def _publish_limits(properties: dict[str, Any], state: ServerState, model_required: bool) -> None:
    """Limits that depend on the served model: its name, its vocabulary and its context."""
    if not state.api.accept_any_model_name:
        names: list[str | None] = list(state.served_model_names)
        properties["model"]["enum"] = names if model_required else [*names, None]
    max_token_id = state.served.vocab_size - 1
    for name in ("prompt", "stop_token_ids", "tokens"):
        _cap_integers(properties.get(name, {}), max_token_id)
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if name in properties:
            _cap_integers(properties[name], state.max_model_len - 1)


def _cap_integers(schema: Any, maximum: int) -> None:
    """Set `maximum` on every integer schema nested in `schema`."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema["maximum"] = maximum
        for value in schema.values():
            _cap_integers(value, maximum)
    elif isinstance(schema, list):
        for item in schema:
            _cap_integers(item, maximum)
