# ruff: noqa: E501  (one schema per line reads better than a wrapped tree)
"""JSON schemas that agents send, used by the structured-output tests, `densa bench structured`
and the grammar-engine comparison: nested objects, enums, arrays, numbers, required fields.

Each comes with a prompt that asks for it, so a small model has a reason to fill it in. Free
strings and arrays carry `maxLength` / `maxItems`, as strict-mode schemas in production commonly
do, so that a 135M model cannot ramble inside one string until max_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchemaCase:
    name: str
    prompt: str
    schema: dict[str, Any]


def _str(max_len: int = 40, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_len, **extra}


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


SCHEMA_CASES: tuple[SchemaCase, ...] = (
    SchemaCase("person", "Describe a person named Ann, aged 31.", _obj({"name": _str(), "age": {"type": "integer", "minimum": 0, "maximum": 150}})),
    SchemaCase("city", "Give the capital of France and its population.", _obj({"city": _str(), "country": _str(), "population": {"type": "integer", "minimum": 0, "maximum": 100000000}})),
    SchemaCase("sentiment", "Classify the sentiment of: 'I love this phone'.", _obj({"label": {"enum": ["positive", "negative", "neutral"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    SchemaCase("weather", "What is the weather in Paris today?", _obj({"location": _str(), "unit": {"enum": ["celsius", "fahrenheit"]}, "temperature": {"type": "number", "minimum": -90, "maximum": 60}, "sunny": {"type": "boolean"}})),
    SchemaCase("shopping", "List three fruits to buy.", _obj({"items": {"type": "array", "items": _str(20), "minItems": 1, "maxItems": 3}})),
    SchemaCase("address", "Write a postal address in London.", _obj({"street": _str(), "city": _str(), "postcode": _str(10), "country": {"enum": ["UK", "US", "FR"]}})),
    SchemaCase("order", "Create an order of two books for customer 42.", _obj({"customer_id": {"type": "integer", "minimum": 1, "maximum": 100000}, "lines": {"type": "array", "maxItems": 3, "items": _obj({"title": _str(), "quantity": {"type": "integer", "minimum": 1, "maximum": 9}})}})),
    SchemaCase("event", "Plan a meeting on Monday at 10.", _obj({"title": _str(), "day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]}, "hour": {"type": "integer", "minimum": 0, "maximum": 23}, "attendees": {"type": "array", "items": _str(20), "maxItems": 4}})),
    SchemaCase("nested", "Describe a company with a CEO.", _obj({"company": _str(), "ceo": _obj({"name": _str(), "contact": _obj({"email": _str(), "phone": _str(20)}, ["email"])})})),
    SchemaCase("optional", "Describe a book; the subtitle is optional.", _obj({"title": _str(), "subtitle": _str(), "pages": {"type": "integer", "minimum": 1, "maximum": 5000}}, ["title", "pages"])),
    SchemaCase("matrix", "Give a 2 by 2 matrix of small numbers.", _obj({"rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "number", "minimum": -10, "maximum": 10}}}})),
    SchemaCase("recipe", "Give a pancake recipe.", _obj({"name": _str(), "servings": {"type": "integer", "minimum": 1, "maximum": 12}, "ingredients": {"type": "array", "maxItems": 4, "items": _obj({"item": _str(20), "grams": {"type": "number", "minimum": 0, "maximum": 1000}})}})),
    SchemaCase("answer", "What is 2 + 3? Answer with the number.", _obj({"answer": {"type": "integer", "minimum": -1000, "maximum": 1000}, "explanation": _str(60)})),
    SchemaCase("flags", "Which features does a basic phone have?", _obj({"camera": {"type": "boolean"}, "wifi": {"type": "boolean"}, "gps": {"type": "boolean"}})),
    SchemaCase("priority", "File a bug report about a crash on start-up.", _obj({"summary": _str(60), "severity": {"enum": ["low", "medium", "high", "critical"]}, "component": {"enum": ["ui", "backend", "database"]}, "steps": {"type": "array", "items": _str(40), "maxItems": 3}})),
    SchemaCase("point", "Give the coordinates of a point.", _obj({"x": {"type": "number", "minimum": -100, "maximum": 100}, "y": {"type": "number", "minimum": -100, "maximum": 100}, "label": _str(10)})),
    SchemaCase("union", "Give an id that is either a number or a short code.", _obj({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99999}, _str(8)]}, "kind": {"const": "record"}})),
    SchemaCase("refs", "Describe two people who are friends.", {"$defs": {"person": _obj({"name": _str(20), "age": {"type": "integer", "minimum": 0, "maximum": 120}})}, **_obj({"first": {"$ref": "#/$defs/person"}, "second": {"$ref": "#/$defs/person"}})}),
    SchemaCase("nullable", "Describe a user who may have no nickname.", _obj({"username": _str(20), "nickname": {"anyOf": [_str(20), {"type": "null"}]}, "active": {"type": "boolean"}})),
    SchemaCase("inventory", "Describe a warehouse with a few products.", _obj({"warehouse": _str(20), "products": {"type": "array", "maxItems": 3, "items": _obj({"sku": _str(12), "stock": {"type": "integer", "minimum": 0, "maximum": 10000}, "tags": {"type": "array", "items": {"enum": ["new", "sale", "fragile"]}, "maxItems": 2}})}})),
    SchemaCase("tool_args", "Search the web for cheap flights to Rome.", _obj({"query": _str(60), "max_results": {"type": "integer", "minimum": 1, "maximum": 20}, "safe_search": {"type": "boolean"}, "language": {"enum": ["en", "it", "fr"]}})),
    SchemaCase("deep", "Describe the layout of a small house.", _obj({"house": _obj({"floors": {"type": "array", "maxItems": 2, "items": _obj({"level": {"type": "integer", "minimum": 0, "maximum": 3}, "rooms": {"type": "array", "maxItems": 3, "items": _obj({"name": _str(16), "area": {"type": "number", "minimum": 1, "maximum": 200}})}})}})})),
)  # fmt: skip
