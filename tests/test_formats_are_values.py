"""Formats are values. KV: sizing and allocation take one KVFormat, never its parts as strings,
and outside its module a KVFormat is made only by its named constructors (`of`, `of_cache`,
`from_wire`, `of_tensors`), so there is one place that turns names into a format. Weights: what
`--weight-format` selects is a LinearFormat and what `--head-format` selects a HeadFormat
(densa.quant.linear_format), asked through their methods; no module compares either with the
options' names. FP4: MXFP4 and NVFP4 are told apart by their Fp4Scheme (densa.formats.fp4),
never by name."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "densa").rglob("*.py"), *(ROOT / "densa_bench").rglob("*.py")])
FORMAT_MODULE = ROOT / "densa" / "formats" / "kv_format.py"
LINEAR_FORMAT_MODULE = ROOT / "densa" / "quant" / "linear_format.py"
# The frozen config validates the option's strings before any value exists: densa.config sits
# below densa.quant (the value's module), so it checks them against its tuple of choices, which
# tests/quant/test_linear_format.py holds equal to LinearFormat.offered().
VALIDATES_STRINGS = {ROOT / "densa" / "config.py"}
# Names that hold the options' strings (or a tuple of them) where the value used to be compared.
FORMAT_NAME_TUPLES = {"WEIGHT_FORMATS", "WEIGHTS_FROM_BLOCKS", "PACKED_FORMATS", "HEAD_FORMATS",
                      "HEAD_FROM_BLOCKS"}  # fmt: skip
# The name `auto` resolves GGUF blocks to: compared with anything, it is a format told by name.
BLOCKS_NAMES = {"WEIGHTS_FROM_BLOCKS", "HEAD_FROM_BLOCKS"}
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


def _mentions_format_option(node: ast.AST) -> bool:
    """`weight_format`, `config.weight_format`, `decode_weight_format`, `head_format`, ...
    anywhere inside."""
    for sub in ast.walk(node):
        name = sub.id if isinstance(sub, ast.Name) else getattr(sub, "attr", None)
        if isinstance(name, str) and name.endswith(("weight_format", "head_format")):
            return True
    return False


def _compares_format_by_name(node: ast.Compare) -> bool:
    operands = [node.left, *node.comparators]
    if any(isinstance(o, ast.Name) and o.id in BLOCKS_NAMES for o in operands):
        return True
    return any(map(_mentions_format_option, operands)) and any(map(_is_format_name, operands))


def _is_format_name(node: ast.AST) -> bool:
    """A string constant, a tuple of them, or one of the modules' tuples of option names."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_format_name(e.value if isinstance(e, ast.Starred) else e) for e in node.elts)
    return isinstance(node, ast.Name) and node.id in FORMAT_NAME_TUPLES


def _format_name_compares(tree: ast.AST) -> list[ast.Compare]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Compare) and _compares_format_by_name(n)]


def test_weight_and_head_formats_are_not_compared_by_name_outside_their_module() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
        for path in SOURCES
        if path != LINEAR_FORMAT_MODULE and path not in VALIDATES_STRINGS
        for node in _format_name_compares(ast.parse(path.read_text()))
    ]
    message = "ask the LinearFormat / HeadFormat (is_auto, packed, ...):\n"
    assert not offenders, message + "\n".join(offenders)


def test_the_scan_sees_weight_and_head_format_compares() -> None:
    caught = _format_name_compares(ast.parse(
        'a = head_format == "auto"\nb = head == HEAD_FROM_BLOCKS\n'
        'c = config.decode_weight_format in ("w4a8", "w8")\nd = head_format != "dense"\n'
        'e = head_format.is_auto\nf = dtype == "auto"\ng = fmt is LinearFormat.W4A8\n'
    ))  # fmt: skip
    assert [ast.unparse(n) for n in caught] == [
        "head_format == 'auto'", "head == HEAD_FROM_BLOCKS",
        "config.decode_weight_format in ('w4a8', 'w8')", "head_format != 'dense'",
    ]  # fmt: skip


# The FP4 schemes' names (densa.formats.fp4.FP4_SCHEME_NAMES); spelled here so that the scan does
# not depend on the module it checks.
FP4_NAMES = {"mxfp4", "nvfp4"}


def _names_fp4_scheme(node: ast.AST) -> bool:
    """A string constant naming an FP4 scheme, or a tuple holding one."""
    if isinstance(node, ast.Constant):
        return node.value in FP4_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_fp4_scheme(e) for e in node.elts)
    return False


def _tests_fp4_name(node: ast.AST) -> bool:
    """`x == "nvfp4"`, `kind in ("mxfp4", ...)`, `name.startswith("nvfp4")`."""
    if isinstance(node, ast.Compare):
        return any(map(_names_fp4_scheme, [node.left, *node.comparators]))
    return (
        isinstance(node, ast.Call)
        and _called_name(node) in ("startswith", "endswith")
        and any(map(_names_fp4_scheme, node.args))
    )


def _fp4_name_tests(tree: ast.AST) -> list[ast.AST]:
    return [node for node in ast.walk(tree) if _tests_fp4_name(node)]


def test_fp4_schemes_are_not_told_apart_by_name() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}: {ast.unparse(node)}"
        for path in SOURCES
        for node in _fp4_name_tests(ast.parse(path.read_text()))
    ]
    assert not offenders, "ask the Fp4Scheme (group, has_tensor_scale, ...):\n" + "\n".join(
        offenders
    )


def test_the_scan_sees_fp4_name_compares() -> None:
    caught = _fp4_name_tests(ast.parse(
        'a = kind == "mxfp4"\nb = k in ("int4", "nvfp4")\nc = f.startswith("nvfp4")\n'
        'd = kind == "int4"\ne = scheme == Fp4Scheme.NVFP4\n'
    ))  # fmt: skip
    assert [ast.unparse(n) for n in caught] == [
        "kind == 'mxfp4'", "k in ('int4', 'nvfp4')", "f.startswith('nvfp4')"
    ]  # fmt: skip
