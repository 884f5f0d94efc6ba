"""`densa eval tools`: tool-call validity on BFCL cases, constrained vs unconstrained, per format.

Every case is asked twice per format, greedily, through the same prompt path the server uses
(the dialect the server would choose from the chat template; Hermes for templates that show
none, and then densa renders the tool definitions itself):

- unconstrained: `tool_choice: auto` -- the model writes whatever it writes, and densa's
  parser for the dialect reads calls out of it;
- constrained: `tool_choice: required` -- the grammar allows only calls of the offered tools
  with schema-valid arguments (openai/tools/formats.py), so validity is guaranteed by
  construction and what remains to measure is whether the call is the right one (AST match).

Reported per format and mode: valid-call rate and AST-match rate with question-bootstrap 95%
intervals, the constrained - unconstrained difference (paired by case), and test - ref
differences (paired by case) for each mode.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from densa.engine.llm import LLM
from densa.openai.tools.formats import AUTO, ToolCallFormat, resolve_format
from densa.openai.tools.models import ToolDefinition
from densa.openai.tools.parser import parse_output
from densa.openai.tools.plan import ToolPlan, plan_tools
from densa.openai.tools.render import render_messages
from densa.sampling_params import SamplingParams
from densa.text.tokenizer import Tokenizer
from densa_bench.common.report import Table
from densa_bench.eval.bfcl import ToolCase, is_ast_match, is_valid_call, load_cases
from densa_bench.eval.common import load_formats
from densa_bench.eval.formats import Format
from densa_bench.eval.report import QualityReport, new_report
from densa_bench.eval.stats import DEFAULT_BOOTSTRAP, Bootstrap, mean_ci, paired_difference_ci

MODES = ("unconstrained", "constrained")


@dataclass(frozen=True)
class ToolEvalSettings:
    limit_simple: int = 70
    limit_multiple: int = 30
    max_tokens: int = 128
    sample_seed: int = 0
    bootstrap: Bootstrap = DEFAULT_BOOTSTRAP

    def __post_init__(self) -> None:
        if (
            self.limit_simple < 0
            or self.limit_multiple < 0
            or not self.limit_simple + self.limit_multiple
        ):
            raise ValueError("limits must be >= 0 and not both 0")


@dataclass(frozen=True)
class CaseResult:
    valid: bool
    ast: bool
    finish_reason: str | None  # "length": cut off by max_tokens (then rarely valid)
    text: str


def load_tool_cases(settings: ToolEvalSettings) -> list[ToolCase]:
    cases = []
    for category, limit in (
        ("simple_python", settings.limit_simple),
        ("multiple", settings.limit_multiple),
    ):
        if limit:
            cases += load_cases(category, limit, settings.sample_seed)
    return cases


def case_prompt(
    tokenizer: Tokenizer, case: ToolCase, plan: ToolPlan, calls_format: ToolCallFormat
) -> list[int]:
    """The case's prompt as the server renders it (openai/prepare.py chat_prompt): a template
    that renders tools gets them; otherwise render_messages writes them into the system
    message."""
    renders_tools = tokenizer.template_renders_tools
    messages = render_messages(
        case.messages, plan.tools, calls_format, renders_tools,
        tokenizer.template_renders_tool_calls,
    )  # fmt: skip
    return tokenizer.encode_chat(messages, plan.tools if renders_tools and plan.tools else None)


def ask(llm: LLM, cases: list[ToolCase], mode: str, max_tokens: int) -> list[CaseResult]:
    prompts: list[str | list[int]] = []
    params = []
    readers: list[ToolCallFormat] = []  # each case's answer is read for its own tools
    calls_format = resolve_format(AUTO, llm.tokenizer)  # as the server chooses it
    for case in cases:
        tools = [ToolDefinition.model_validate(t) for t in case.tools]
        plan = plan_tools(
            calls_format, tools, "required" if mode == "constrained" else "auto", False, None
        )
        prompts.append(case_prompt(llm.tokenizer, case, plan, calls_format))
        readers.append(calls_format.with_tools(plan.tools))  # as the server binds them
        params.append(
            SamplingParams(
                temperature=0,
                max_tokens=max_tokens,
                structured=plan.constraint,
                kept_special_token_ids=plan.marker_token_ids,
            )
        )
    results = []
    generations = llm.generate(prompts, params)
    for case, reader, generation in zip(cases, readers, generations, strict=True):
        parsed = parse_output(reader, generation.text)
        calls = [(c.name, c.arguments) for c in parsed.tool_calls]
        results.append(
            CaseResult(
                is_valid_call(case, calls),
                is_ast_match(case, calls),
                generation.finish_reason,
                generation.text,
            )
        )
    return results


def run_tool_eval(ref: Format, tests: list[Format], settings: ToolEvalSettings) -> QualityReport:
    cases = load_tool_cases(settings)
    formats = [ref, *tests]
    results: dict[tuple[str, str], list[CaseResult]] = {}
    for fmt, llm in zip(formats, load_formats(formats), strict=True):
        for mode in MODES:
            results[(fmt.label, mode)] = ask(llm, cases, mode, settings.max_tokens)
    return _report(formats, settings, cases, results)


def _report(
    formats: list[Format],
    settings: ToolEvalSettings,
    cases: list[ToolCase],
    results: dict[tuple[str, str], list[CaseResult]],
) -> QualityReport:
    report = new_report("tools", formats, asdict(settings) | {"num_cases": len(cases)})
    rows: list[list[str]] = []
    summary: list[dict[str, Any]] = []
    for fmt in formats:
        _format_rows(fmt.label, formats[0].label, results, settings.bootstrap, rows, summary)
    report.summary = summary
    report.samples = [
        {"label": label, "mode": mode, "case": case.case_id, **asdict(r)}
        for (label, mode), mine in results.items()
        for case, r in zip(cases, mine, strict=True)
    ]
    report.tables.append(
        Table(
            f"BFCL tool calls, % ({len(cases)} cases: simple_python {settings.limit_simple}, "
            f"multiple {settings.limit_multiple}; 95% CIs)",
            ["format", "mode", "valid call", "AST match", "AST Δ vs ref (paired)", "cut off"],
            rows,
        )
    )
    report.notes += NOTES
    return report


def _format_rows(
    label: str,
    ref: str,
    results: dict[tuple[str, str], list[CaseResult]],
    boot: Bootstrap,
    rows: list[list[str]],
    summary: list[dict[str, Any]],
) -> None:
    """One format's table rows and summary entries: each mode, then what constraining gains."""
    for mode in MODES:
        mine = results[(label, mode)]
        valid = [float(r.valid) for r in mine]
        ast = [float(r.ast) for r in mine]
        entry: dict[str, Any] = {
            "label": label,
            "mode": mode,
            "valid": mean_ci(valid, boot).to_json(),
            "ast": mean_ci(ast, boot).to_json(),
            "num_cut_off": sum(r.finish_reason == "length" for r in mine),
        }
        vs_ref = ""
        if label != ref:
            ref_ast = [float(r.ast) for r in results[(ref, mode)]]
            delta = paired_difference_ci(ref_ast, ast, boot)
            entry["ast_delta_vs_ref"] = delta.to_json()
            vs_ref = delta.format(".1f", 100)
        summary.append(entry)
        rows.append(
            [
                label,
                mode,
                mean_ci(valid, boot).format(".1f", 100),
                mean_ci(ast, boot).format(".1f", 100),
                vs_ref,
                f"{entry['num_cut_off']}/{len(mine)}",
            ]
        )
    unconstrained = [float(r.ast) for r in results[(label, "unconstrained")]]
    constrained = [float(r.ast) for r in results[(label, "constrained")]]
    gain = paired_difference_ci(unconstrained, constrained, boot)
    summary.append({"label": label, "ast_constrained_minus_unconstrained": gain.to_json()})
    rows.append(
        [label, "constrained - unconstrained (AST, paired)", "", gain.format(".1f", 100), "", ""]
    )


NOTES = [
    "valid call = at least one call, every call of an offered function with arguments that "
    "validate against its schema; AST match = BFCL's simple/multiple rule (one call, right "
    "function, accepted values). Constrained decoding makes every finished answer a valid "
    "call by construction; a constrained answer cut off by max_tokens is not.",
    "BFCL's parameter schemas do not set additionalProperties: false, so a constrained call "
    "may add keys of its own (schema-valid, but an AST mismatch, as in BFCL) and run on "
    "until max_tokens ('cut off'); strict schemas close that door.",
    "A 135M model is near the floor of BFCL when unconstrained: it rarely writes a call in "
    "the format at all, so unconstrained rates measure format-following more than function "
    "choice. Constrained rates show what the model picks once the format is guaranteed.",
]
