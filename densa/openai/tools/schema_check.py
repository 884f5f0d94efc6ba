"""Which JSON-schema features constrained decoding supports, checked in pure Python at the front.

The grammar engine (llguidance) compiles most of JSON Schema; the keywords below it cannot
enforce, and a schema using one gets a 400 naming the keyword and where it is, instead of an
output that silently ignores it. Remote `$ref`s are refused too (nothing is fetched), and size
and depth are bounded so a hostile schema cannot make the compile expensive.
"""

from __future__ import annotations

from typing import Any

# Measured against llguidance 1.9.1: it reports these as unimplemented.
UNSUPPORTED_KEYWORDS = frozenset(
    {
        "if",
        "then",
        "else",
        "not",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "propertyNames",
        "unevaluatedProperties",
        "unevaluatedItems",
        "$dynamicRef",
        "$recursiveRef",
    }
)
# Keywords whose value is a map of names to subschemas, or a list of subschemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SCHEMA_VALUES = frozenset({"items", "additionalProperties", "additionalItems"})
MAX_DEPTH = 32
MAX_NODES = 2000


class UnsupportedSchema(ValueError):
    """A schema constrained decoding cannot enforce; the message names the feature and path."""


def check_schema(schema: Any, where: str = "schema") -> None:
    """Raise UnsupportedSchema if `schema` uses a feature the grammar engine cannot enforce."""
    if not isinstance(schema, dict):
        raise UnsupportedSchema(f"{where} must be a JSON object (a JSON Schema)")
    budget = [MAX_NODES]
    _check(schema, where, 0, budget)


def _check(node: Any, path: str, depth: int, budget: list[int]) -> None:
    if isinstance(node, bool):  # `true` / `false` are valid schemas (anything / nothing)
        return
    if not isinstance(node, dict):
        raise UnsupportedSchema(f"{path} must be a schema (an object or a boolean)")
    budget[0] -= 1
    if budget[0] < 0:
        raise UnsupportedSchema(f"the schema has more than {MAX_NODES} subschemas")
    if depth > MAX_DEPTH:
        raise UnsupportedSchema(f"{path} nests deeper than {MAX_DEPTH} levels")
    for keyword, value in node.items():
        here = f"{path}.{keyword}"
        if keyword in UNSUPPORTED_KEYWORDS:
            raise UnsupportedSchema(
                f"{here}: the JSON Schema keyword {keyword!r} is not supported by "
                "constrained decoding; remove it or enforce it after parsing"
            )
        if keyword == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise UnsupportedSchema(f"{here}: only local references ('#/...') are supported")
        _check_children(keyword, value, here, depth, budget)


def _check_children(keyword: str, value: Any, path: str, depth: int, budget: list[int]) -> None:
    if keyword in _SCHEMA_MAPS:
        if not isinstance(value, dict):
            raise UnsupportedSchema(f"{path} must be an object of schemas")
        for name, child in value.items():
            _check(child, f"{path}.{name}", depth + 1, budget)
    elif keyword in _SCHEMA_LISTS:
        if not isinstance(value, list) or not value:
            raise UnsupportedSchema(f"{path} must be a non-empty list of schemas")
        for idx, child in enumerate(value):
            _check(child, f"{path}[{idx}]", depth + 1, budget)
    elif keyword in _SCHEMA_VALUES and isinstance(value, dict | bool):
        _check(value, path, depth + 1, budget)
