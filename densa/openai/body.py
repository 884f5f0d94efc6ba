"""The base of every request body: strict types, unknown fields refused, null means unset.

Shared by the OpenAI bodies (protocol.py) and the tool / response-format ones (tools/models.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


def publish_nullable(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Every optional field also accepts null (what the before-validator below reads as unset)."""
    required = set(schema.get("required", []))
    for name, prop in schema.get("properties", {}).items():
        if name in required or allows_null(prop):
            continue
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}]}


def allows_null(prop: dict[str, Any]) -> bool:
    return prop.get("type") == "null" or any(
        option.get("type") == "null" for option in prop.get("anyOf", [])
    )


class RequestBody(BaseModel):
    # Strict: JSON types must match (true is not 1, "0.5" is not 0.5); ints pass as floats, and
    # integral floats as ints (fields.INTEGRAL). Unknown fields are refused, as OpenAI does.
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=publish_nullable)

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        """OpenAI clients send `"stream": null` for "not given": drop nulls of optional fields."""
        if not isinstance(data, dict):
            return data
        optional = {name for name, f in cls.model_fields.items() if not f.is_required()}
        return {k: v for k, v in data.items() if not (v is None and k in optional)}
