"""KV formats are values: sizing and allocation take one KVFormat, never its parts as strings,
and outside its module a KVFormat is made only by its named constructors (`of`, `of_cache`,
`from_wire`, `of_tensors`), so there is one place that turns names into a format."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "densa").rglob("*.py"), *(ROOT / "densa_bench").rglob("*.py")])
FORMAT_MODULE = ROOT / "densa" / "formats" / "kv_format.py"
# densa.model.kv_pages: each takes (arch, ..., kv_format: KVFormat, ...).
SIZED_BY_FORMAT = {"page_bytes", "bytes_per_token", "value_bytes_per_token",
                   "scale_bytes_per_token", "num_pages_for_budget", "allocate_kv_caches",
                   "kv_capacity", "draft_page_bytes"}  # fmt: skip


def _called_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def _calls(path: Path) -> list[ast.Call]:
    return [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)]


def test_pages_are_sized_and_allocated_from_a_kv_format_not_strings() -> None:
    offenders = []
    for path in SOURCES:
        for call in _calls(path):
            if _called_name(call) not in SIZED_BY_FORMAT:
                continue
            args = [*call.args, *(k.value for k in call.keywords)]
            if any(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in args):
                offenders.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert not offenders, "called with a dtype or policy string:\n" + "\n".join(offenders)


def test_a_kv_format_is_made_through_its_named_constructors() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{call.lineno}"
        for path in SOURCES
        if path != FORMAT_MODULE
        for call in _calls(path)
        if isinstance(call.func, ast.Name) and call.func.id == "KVFormat"
    ]
    assert not offenders, "use KVFormat.of / of_cache / from_wire:\n" + "\n".join(offenders)
