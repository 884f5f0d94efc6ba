"""GSM8K answer extraction and trial intervals; BFCL loading, schema mapping and the two call
checks; one tiny end-to-end run of `densa eval tools` to show constrained answers are valid."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from densa_bench.eval import bfcl, gsm8k
from densa_bench.eval.formats import parse_format
from densa_bench.eval.tool_calls import ToolEvalSettings, load_tool_cases, run_tool_eval

from .conftest import tiny_base


def test_gsm8k_problems_and_answers() -> None:
    problems = gsm8k.load_problems()
    assert len(problems) == 1319
    assert problems[0].answer == "18"
    assert gsm8k.extract_answer("so 9 * 2 = 18 dollars.\n#### 18") == "18"
    assert gsm8k.extract_answer("The answer is $1,250.00.") == "1250"
    assert gsm8k.extract_answer("#### 3.50 then 7") == "3.5"
    assert gsm8k.extract_answer("no number") is None
    messages = gsm8k.few_shot_messages(problems[:2], "Q?")
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert "<<" not in messages[1]["content"]


def test_interval_across_trials() -> None:
    estimate = gsm8k.across_trials([0.1, 0.2, 0.3, 0.2, 0.2])
    assert estimate.value == pytest.approx(0.2)
    half = 2.776 * 0.0707106781 / 5**0.5  # t(0.975, 4) * sd / sqrt(n)
    assert estimate.low == pytest.approx(0.2 - half, rel=1e-6)


def test_bfcl_cases_map_to_json_schema() -> None:
    [case] = [c for c in bfcl.load_cases("multiple", limit=None) if c.case_id == "multiple_0"]
    names = [t["function"]["name"] for t in case.tools]
    assert names == ["triangle_properties_get", "circle_properties_get"]
    assert case.names["triangle_properties_get"] == "triangle_properties.get"
    radius = case.tools[1]["function"]["parameters"]["properties"]["radius"]
    assert radius["type"] == "number"
    assert case.tools[0]["function"]["parameters"]["type"] == "object"
    assert len(bfcl.load_cases("simple_python", limit=7, seed=1)) == 7


def test_bfcl_call_checks() -> None:
    [case] = [c for c in bfcl.load_cases("simple_python") if c.case_id == "simple_python_0"]
    good = [("calculate_triangle_area", '{"base": 10, "height": 5}')]
    assert bfcl.is_valid_call(case, good) and bfcl.is_ast_match(case, good)
    assert bfcl.is_ast_match(
        case, [("calculate_triangle_area", '{"base": 10, "height": 5, "unit": "Units"}')]
    )
    wrong_value = [("calculate_triangle_area", '{"base": 11, "height": 5}')]
    assert bfcl.is_valid_call(case, wrong_value) and not bfcl.is_ast_match(case, wrong_value)
    bad_type = [("calculate_triangle_area", '{"base": "ten", "height": 5}')]
    assert not bfcl.is_valid_call(case, bad_type)
    assert not bfcl.is_valid_call(case, [("other", "{}")])
    assert not bfcl.is_valid_call(case, [])
    assert not bfcl.is_ast_match(case, good + good)  # one call expected


def test_tool_eval_end_to_end_on_the_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    ref = parse_format("ref:", tiny_base(tiny_model_dir))
    fp8 = parse_format("fp8:kv_cache_dtype=fp8_e4m3", tiny_base(tiny_model_dir))
    settings = ToolEvalSettings(limit_simple=2, limit_multiple=1, max_tokens=96)
    report = run_tool_eval(ref, [fp8], settings)
    constrained = [s for s in report.samples if s["mode"] == "constrained"]
    assert len(constrained) == 6
    # Guaranteed by the grammar for every finished answer; a random model writes BFCL's
    # unbounded strings until max_tokens, but always inside a call of an offered function.
    assert all(s["valid"] for s in constrained if s["finish_reason"] == "stop")
    cases = {c.case_id: c for c in load_tool_cases(settings)}
    for sample in constrained:
        names = "|".join(t["function"]["name"] for t in cases[sample["case"]].tools)
        assert re.match(rf'<tool_call>\n\{{"name": "({names})", "arguments": \{{', sample["text"])
    paths = report.write(tmp_path)
    summary = json.loads(paths[0].read_text())["summary"]
    assert [(e.get("label"), e.get("mode")) for e in summary[:2]] == [
        ("ref", "unconstrained"),
        ("ref", "constrained"),
    ]
    assert "ast_delta_vs_ref" in summary[4] and summary[4]["label"] == "fp8"


@pytest.mark.parametrize("num_seeds", [0, 2])
def test_gsm8k_report_greedy_only_or_with_sampled_trials(
    tiny_model_dir: Path, num_seeds: int
) -> None:
    """--num-seeds 0 reports greedy accuracy and its paired delta only (no sampled columns)."""
    ref = parse_format("bf16:kv_cache_dtype=bfloat16", tiny_base(tiny_model_dir))
    test = parse_format("int8:kv_cache_dtype=int8", tiny_base(tiny_model_dir))
    problems = gsm8k.load_problems()[4:8]
    greedy = {"bf16": [True, True, False, False], "int8": [True, False, False, False]}
    sampled = {label: [v] * num_seeds for label, v in greedy.items()}
    settings = gsm8k.GSM8KSettings(limit=4, num_seeds=num_seeds)
    report = gsm8k._report([ref, test], settings, problems, greedy, sampled)
    table = report.tables[-1]
    assert len(table.columns) == (3 if num_seeds == 0 else 5)
    assert [row[0] for row in table.rows] == ["bf16", "int8"]
    assert report.summary[1]["greedy_delta"]["value"] == pytest.approx(-0.25)
    assert ("sampled_delta" in report.summary[1]) == (num_seeds > 0)


def test_gsm8k_settings_refuse_a_single_sampled_trial() -> None:
    with pytest.raises(ValueError, match="num_seeds 0 or >= 2"):
        gsm8k.GSM8KSettings(num_seeds=1)


def test_a_template_that_renders_tools_gets_them_in_the_eval_prompt(
    real_model: Callable[[str], Path],
) -> None:
    """Qwen2.5's template renders `tools` itself: the eval must pass them to it, as the server
    does (without them the prompt offers no function, and the model answers in prose)."""
    from densa.model.loader import resolve_model_dir
    from densa.openai.tools.formats import AUTO, resolve_format
    from densa.openai.tools.models import ToolDefinition
    from densa.openai.tools.plan import plan_tools
    from densa.text.tokenizer import Tokenizer
    from densa_bench.eval.tool_calls import case_prompt

    tokenizer = Tokenizer.from_dir(resolve_model_dir(str(real_model("qwen2.5-coder-0.5b"))))
    assert tokenizer.template_renders_tools
    [case] = load_tool_cases(ToolEvalSettings(limit_simple=1, limit_multiple=0))
    calls_format = resolve_format(AUTO, tokenizer)
    tools = [ToolDefinition.model_validate(t) for t in case.tools]
    plan = plan_tools(calls_format, tools, "auto", False, None)
    text = tokenizer.decode(case_prompt(tokenizer, case, plan, calls_format), False)
    assert "<tools>" in text and case.tools[0]["function"]["name"] in text
