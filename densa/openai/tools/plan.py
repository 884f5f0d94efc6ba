"""One chat request's tool and structured-output plan: what the prompt shows, what constrains
the output, and whether the answer is parsed for calls.

    tool_choice   tools in the prompt   constraint                      calls parsed
    none          no                    response_format or              no
                                        structured_outputs, if any
    auto          yes                   none (the model chooses)        yes
    required      yes                   one or more calls of any tool   yes
    {function}    yes (that tool only)  one call of that tool           yes
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from densa.openai.tools.formats import ToolCallFormat
from densa.openai.tools.models import (
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputs,
    ToolChoice,
    ToolDefinition,
)
from densa.openai.tools.schema_check import check_schema
from densa.sampling_params import StructuredOutput


class ToolRequestError(ValueError):
    """A tools / response_format combination that cannot be served; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]]  # definitions shown in the prompt (OpenAI's JSON shape)
    constraint: StructuredOutput | None
    parse_calls: bool  # read tool calls back out of the answer
    # The dialect's marker tokens: decoded into the text even where they are special tokens.
    marker_token_ids: tuple[int, ...] = ()


NO_TOOLS = ToolPlan([], None, False)


def plan_tools(
    fmt: ToolCallFormat,
    tools: list[ToolDefinition] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputs | None = None,
) -> ToolPlan:
    """Raises ToolRequestError for what cannot be honoured (a 400 naming the field)."""
    answer_constraint = response_constraint(response_format)
    if structured_outputs is not None:
        if answer_constraint is not None:
            raise ToolRequestError(
                "response_format and structured_outputs cannot both constrain the answer",
                "structured_outputs",
            )
        answer_constraint = output_constraint(structured_outputs)
    if tool_choice not in (None, "none") and not tools:
        raise ToolRequestError("tool_choice needs tools", "tool_choice")
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if not tools or choice == "none":
        return ToolPlan([], answer_constraint, False)
    if answer_constraint is not None:
        raise ToolRequestError(
            f"{'response_format' if response_format else 'structured_outputs'} cannot be "
            "combined with tools unless tool_choice is 'none'",
            "response_format" if response_format else "structured_outputs",
        )
    for idx, tool in enumerate(tools):
        if tool.function.parameters is not None:
            _check(tool.function.parameters, f"tools[{idx}].function.parameters")
    definitions = [tool.model_dump(exclude_none=True) for tool in tools]
    markers = tuple(sorted(fmt.tokens.values()))
    if isinstance(choice, NamedToolChoice):
        named = [d for d in definitions if d["function"]["name"] == choice.function.name]
        if not named:
            raise ToolRequestError(
                f"tool_choice names {choice.function.name!r}, which is not in tools",
                "tool_choice",
            )
        return ToolPlan(named, fmt.call_grammar(named, parallel=False), True, markers)
    if choice == "required":
        parallel = parallel_tool_calls is not False
        return ToolPlan(definitions, fmt.call_grammar(definitions, parallel), True, markers)
    return ToolPlan(definitions, None, True, markers)


def output_constraint(outputs: StructuredOutputs) -> StructuredOutput:
    """A regex or choice constraint as a Lark grammar (the engine compiles it; a regex it
    cannot parse comes back as a 400 invalid_grammar)."""
    if outputs.regex is not None:
        return StructuredOutput("lark", f"start: /{_lark_regex_body(outputs.regex)}/")
    choices = outputs.choice or []
    return StructuredOutput("lark", "start: " + " | ".join(json.dumps(c) for c in choices))


def _lark_regex_body(regex: str) -> str:
    """The regex between Lark's slashes: an unescaped '/' would end it, so it becomes '\\/';
    escape pairs ('\\/', '\\\\') pass through unchanged."""
    out, chars = [], iter(regex)
    for char in chars:
        if char == "\\":
            out.append(char + next(chars, ""))  # a lone final backslash: the engine refuses it
        elif char == "/":
            out.append("\\/")
        else:
            out.append(char)
    return "".join(out)


def response_constraint(response_format: ResponseFormat | None) -> StructuredOutput | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput("json_object")
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise ToolRequestError(
            "response_format json_schema needs json_schema.schema", "response_format.json_schema"
        )
    _check(spec.json_schema, "response_format.json_schema.schema")
    return StructuredOutput("json_schema", json.dumps(spec.json_schema))


def _check(schema: dict[str, Any], param: str) -> None:
    try:
        check_schema(schema, param)
    except ValueError as exc:
        raise ToolRequestError(str(exc), param) from exc
