"""Berkeley Function Calling Leaderboard cases, read offline from the `bfcl-eval` package, and
the two checks `densa eval tools` makes of a model's calls.

Cases: `bfcl_eval/data/BFCL_v4_{simple_python,multiple}.json` (a question and the functions it
may call), ground truth in `possible_answer/` (per parameter, the values accepted; "" = may be
omitted). BFCL writes schemas in Python terms: `dict`, `float`, `tuple` and `any` become JSON
Schema `object`, `number`, `array` and no type; function names with dots (`math.gcd`) are
written with underscores, as BFCL does for OpenAI-style APIs, and mapped back for matching.

- valid call: the answer holds at least one call, every call names an offered function and its
  arguments parse and validate against that function's parameter schema (jsonschema);
- AST match: BFCL's "simple"/"multiple" rule, reimplemented: exactly one call, of the expected
  function, every required parameter present, no unknown one, each value among the accepted
  ones (strings compared as BFCL does: case, spaces and ",./-_*^" ignored; ints equal floats).
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PACKAGE = "bfcl_eval"
INSTALL_HINT = "run `scripts/setup.sh dev` (or `pip install --no-deps bfcl-eval==2026.3.23`)"
CATEGORIES = ("simple_python", "multiple")
_TYPES = {"dict": "object", "float": "number", "tuple": "array"}
_STANDARDIZE = re.compile(r"[ ,./\-_*^]")


@dataclass(frozen=True)
class ToolCase:
    case_id: str
    category: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]  # OpenAI tool definitions (names with "_" for ".")
    names: dict[str, str]  # OpenAI-safe name -> BFCL name
    ground_truth: list[dict[str, dict[str, list[Any]]]]


def data_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the BFCL data is missing: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def load_cases(category: str, limit: int | None = None, seed: int = 0) -> list[ToolCase]:
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; choose from {', '.join(CATEGORIES)}")
    root = data_dir()
    questions = _jsonl(root / f"BFCL_v4_{category}.json")
    answers = {
        row["id"]: row["ground_truth"]
        for row in _jsonl(root / "possible_answer" / f"BFCL_v4_{category}.json")
    }
    cases = [_case(row, category, answers[row["id"]]) for row in questions]
    if limit is not None and limit < len(cases):
        keep = sorted(random.Random(seed).sample(range(len(cases)), limit))
        cases = [cases[idx] for idx in keep]
    return cases


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {INSTALL_HINT}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _case(row: dict[str, Any], category: str, truth: list[dict[str, Any]]) -> ToolCase:
    names = {f["name"].replace(".", "_"): f["name"] for f in row["function"]}
    tools = [
        {
            "type": "function",
            "function": {
                "name": function["name"].replace(".", "_"),
                "description": function.get("description", ""),
                "parameters": to_json_schema(function["parameters"]),
            },
        }
        for function in row["function"]
    ]
    return ToolCase(row["id"], category, list(row["question"][0]), tools, names, truth)


def to_json_schema(schema: Any) -> Any:
    """A BFCL parameter schema in JSON Schema terms (recursively)."""
    if isinstance(schema, list):
        return [to_json_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    converted: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            if value == "any":
                continue
            converted[key] = _TYPES.get(value, value)
        elif key in ("properties",):
            converted[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "anyOf", "oneOf"):
            converted[key] = to_json_schema(value)
        elif key != "optional":  # BFCL's own annotation, not JSON Schema
            converted[key] = value
    return converted


# ---- checks ------------------------------------------------------------------------------------
def is_valid_call(case: ToolCase, calls: list[tuple[str, str]]) -> bool:
    """calls: (name, arguments JSON text) as parsed from the answer."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in case.tools}
    if not calls:
        return False
    for name, arguments in calls:
        args = _load(arguments)
        if name not in schemas or not isinstance(args, dict):
            return False
        try:
            jsonschema.validate(args, schemas[name])
        except jsonschema.ValidationError:
            return False
    return True


def is_ast_match(case: ToolCase, calls: list[tuple[str, str]]) -> bool:
    if len(calls) != 1 or len(case.ground_truth) != 1:
        return False
    name, arguments = calls[0]
    args = _load(arguments)
    [(expected_name, expected)] = case.ground_truth[0].items()
    if case.names.get(name) != expected_name or not isinstance(args, dict):
        return False
    if any(key not in expected for key in args):
        return False
    for key, accepted in expected.items():
        if key not in args:
            if "" not in accepted:
                return False
        elif not any(_equal(args[key], value) for value in accepted if value != ""):
            return False
    return True


def _equal(value: Any, accepted: Any) -> bool:
    if isinstance(accepted, str) and isinstance(value, str):
        return _standardize(value) == _standardize(accepted)
    if isinstance(accepted, bool) or isinstance(value, bool):
        return type(value) is type(accepted) and value == accepted
    if isinstance(accepted, int | float) and isinstance(value, int | float):
        return float(value) == float(accepted)
    if isinstance(accepted, list) and isinstance(value, list):
        return len(value) == len(accepted) and all(map(_equal, value, accepted))
    if isinstance(accepted, dict) and isinstance(value, dict):
        return all(
            (key in value and any(_equal(value[key], a) for a in options if a != ""))
            or (key not in value and "" in options)
            for key, options in accepted.items()
        ) and all(key in accepted for key in value)
    return bool(value == accepted)


def _standardize(text: str) -> str:
    return _STANDARDIZE.sub("", text).lower().replace("'", '"')


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
