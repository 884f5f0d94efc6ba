"""The layering of ARCHITECTURE.md, enforced: a module imports only from its own layer or below,
and page bookkeeping and scheduling (L0-L2) never import torch."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "densa"

LAYERS = {
    "utils": 0,
    "config": 1,
    "sampling_params": 1,
    "request": 1,
    "cache": 2,
    "sched": 2,
    "kernels": 3,
    "quant": 3,
    # Statistics, reports, plots and offline data: shared by bench, eval and by calibration
    # (GPTQ reads its text through it), so it sits with the lowest of them.
    "measure": 3,
    "memory": 3,  # huge-page allocation for weights (model/) and KV pages (worker/)
    "model": 4,
    "worker": 5,
    "disagg": 5,
    "engine": 6,
    "serve": 7,
    "bench": 7,
    "eval": 7,
    "tools": 7,
    "cli": 7,
    "__init__": 7,
}
TORCH_FREE_BELOW = 3
TORCH_FREE_MODULES = {"serve.router"}  # the router stays light: no torch


def _module_key(path: Path) -> str:
    return path.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", ".")


def _layer(dotted: str) -> int:
    top = dotted.split(".")[0]
    assert top in LAYERS, f"module densa.{dotted} has no layer in the table; add it"
    return LAYERS[top]


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_every_module_respects_the_layers() -> None:
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        key = _module_key(path)
        layer = _layer(key)
        for name in _imports(path):
            if name.startswith("densa."):
                target = name.removeprefix("densa.")
                if _layer(target) > layer:
                    violations.append(
                        f"densa.{key} (L{layer}) imports densa.{target} (L{_layer(target)})"
                    )
            elif name.split(".")[0] == "torch" and (
                layer < TORCH_FREE_BELOW or key in TORCH_FREE_MODULES
            ):
                violations.append(f"densa.{key} (L{layer}) imports torch")
    assert not violations, "\n".join(violations)


def test_the_table_knows_every_top_level_module() -> None:
    tops = {_module_key(p).split(".")[0] for p in PACKAGE.rglob("*.py")}
    assert tops <= set(LAYERS), sorted(tops - set(LAYERS))


def test_bench_and_eval_share_measure_not_each_other() -> None:
    """Benchmarks and quality evaluations are siblings: what both need lives in densa.measure."""
    crossings = []
    for a, b in (("bench", "eval"), ("eval", "bench")):
        for path in sorted((PACKAGE / a).rglob("*.py")):
            crossings += [
                f"densa.{_module_key(path)} imports {name}"
                for name in _imports(path)
                if name == f"densa.{b}" or name.startswith(f"densa.{b}.")
            ]
    assert not crossings, "\n".join(crossings)
