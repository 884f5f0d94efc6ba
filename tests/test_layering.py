"""The layering of ARCHITECTURE.md, enforced: a module imports only from its own layer or below,
and page bookkeeping and scheduling (L0-L2) never import torch."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "densa"
# Measurement (benchmarks, evaluations) beside densa: above every layer, it may import any densa
# module; densa imports it only in the entry points of densa/cli.py, inside a function.
BENCH_PACKAGE = PACKAGE.parent / "densa_bench"

LAYERS = {
    "utils": 0,
    "auth": 0,  # the cluster secret and what is derived from it (hmac only)
    "config": 1,
    "sampling_params": 1,
    "request": 1,
    "text": 1,
    "cache": 2,
    "sched": 2,
    # Within L3 imports run one way: formats (block layouts, scale math) <- kernels <- quant.
    "formats": 3,
    "kernels": 3,
    "quant": 3,
    "memory": 3,  # huge-page allocation for weights (model/) and KV pages (worker/)
    # The public API's shapes (OpenAI, Anthropic Messages, Responses; tool calls, reasoning),
    # shared by serve, router and eval: pydantic and text, no engine, no torch (FRONT_MODULES).
    "openai": 3,
    "model": 4,
    "worker": 5,
    "disagg": 5,
    # Speculative proposers: a draft model (model/) with its own KV, sampling; engine/ drives them.
    "spec": 5,
    # Construction apart from the loop: options -> frozen config -> parts; engine/ (the same
    # layer) builds itself through it (LLMEngine.from_args).
    "setup": 6,
    "engine": 6,
    "ipc": 1,
    "serve": 7,
    "router": 7,
    "cluster": 7,  # runs routers and workers as processes; imports router.membership only
    "offline": 7,  # quantize, capacity, KV calibration, scoring: drives engine/ from outside
    "cli": 7,
    "__init__": 7,
}
TORCH_FREE_BELOW = 3
# The router stays light: no torch (see also below).
TORCH_FREE_MODULES = {f"router.{m}" for m in ("app", "cli", "config", "incoming", "lengths",
                      "metrics", "policy", "prefix", "proxy", "ring", "routing", "sessions", "tokens",
                      "workers", "membership")}  # fmt: skip


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
    assert set(LAYERS) <= tops, f"rooms that no longer exist: {sorted(set(LAYERS) - tops)}"


def test_densa_imports_densa_bench_only_in_the_cli_entry_points() -> None:
    """densa knows nothing of its measurement package: no module imports densa_bench, except
    densa/cli.py inside a function (the lazy `densa bench` / `densa eval` entry points)."""
    offenders = [
        f"densa.{_module_key(path)} imports {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name in _imports(path)
        if name.split(".")[0] == "densa_bench"
        and not (_module_key(path) == "cli" and name not in _module_level_imports(path))
    ]
    assert not offenders, "\n".join(offenders)


def test_benchmarks_and_evaluations_share_common_not_each_other() -> None:
    """Benchmarks and quality evaluations are siblings: what both need lives in
    densa_bench.common, and no benchmark imports an evaluation or the other way round."""
    crossings = []
    for path in sorted(BENCH_PACKAGE.rglob("*.py")):
        room = path.relative_to(BENCH_PACKAGE).parts[0]
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] != "densa_bench" or len(parts) < 2 or parts[1] in ("common", "cli"):
                continue
            if (room == "eval") != (parts[1] == "eval"):
                crossings.append(f"densa_bench/{path.relative_to(BENCH_PACKAGE)} imports {name}")
    assert not crossings, "\n".join(crossings)


def test_the_router_does_not_import_serve() -> None:
    """The router and the server are peers: what both need of the API is in densa.openai."""
    crossings = [
        f"densa.{_module_key(path)} imports {name}"
        for path in sorted((PACKAGE / "router").rglob("*.py"))
        for name in _imports(path)
        if name == "densa.serve" or name.startswith("densa.serve.")
    ]
    assert not crossings, "\n".join(crossings)


def test_rooms_of_one_layer_import_one_way() -> None:
    """formats (layouts and scale math) import no kernel and no quantizer; kernels import formats,
    never quant; quant imports both. So a format's formulas sit below every kernel reading it.
    setup/ (options -> config -> parts) never imports the engine loop it builds."""
    forbidden = {
        "formats": ("kernels", "quant"),
        "kernels": ("quant",),
        # Construction sits beside the loop: engine/ builds itself through setup/, never back.
        "setup": ("engine",),
    }
    crossings = []
    for package, above in forbidden.items():
        for path in sorted((PACKAGE / package).rglob("*.py")):
            crossings += [
                f"densa.{_module_key(path)} imports {name}"
                for name in _imports(path)
                for top in above
                if name == f"densa.{top}" or name.startswith(f"densa.{top}.")
            ]
    assert not crossings, "\n".join(crossings)


# ---- the HTTP front (and the router) never import torch, even indirectly --------------------------
FRONT_MODULES = [
    "densa.serve",
    "densa.serve.api_server",
    "densa.serve.routes.openai",
    "densa.serve.process",
    "densa.engine.client",
    "densa.engine.launch",
    "densa.serve.generation",
    "densa.openai.prepare",
    "densa.openai.responses",
    "densa.serve.metrics",
    "densa.serve.tracking",
    "densa.openai",
    "densa.openai.http_protocol",
    "densa.openai.framing",
    "densa.openai.anthropic_api.formatter",
    "densa.openai.responses_api.formatter",
    "densa.openai.tools.formats",
    "densa.ipc.messages",
    "densa.ipc.codec",
    "densa.ipc.transport",
    "densa.text.tokenizer",
    "densa.text.output",
    "densa.cli",
    "densa.serve.peer",
    "densa.router",
    "densa.router.app",
    "densa.router.cli",
    "densa.router.proxy",
    "densa.router.routing",
    "densa.router.workers",
    "densa.cluster.config",
    "densa.cluster.processes",
    "densa.cluster.cli",
]
# Heavy numeric stacks the front has no business loading (they cost seconds and gigabytes).
BLOCKED = ("torch", "numpy", "numba", "transformers", "triton")
_BLOCKING_SCRIPT = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"the front imported {{name}}")
sys.meta_path.insert(0, Block())
import importlib
for module in {modules!r}:
    importlib.import_module(module)
for module in {modules!r}:
    importlib.import_module(module)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {blocked!r})
assert not loaded, loaded
print("ok")
"""


def test_the_front_imports_no_torch_even_transitively() -> None:
    """Every front module imports in a fresh interpreter where importing torch (or numpy,
    numba, transformers, triton) raises."""
    import subprocess
    import sys

    script = _BLOCKING_SCRIPT.format(blocked=BLOCKED, modules=FRONT_MODULES)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def _module_level_imports(path: Path) -> list[str]:
    """Imports that run when the module is imported (not those inside functions, which load
    only when called -- `densa bench` imports torch that way -- nor TYPE_CHECKING blocks)."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_front_modules_reach_no_torch_module_through_densa() -> None:
    """The static view of the same rule: following the module-level imports of densa's own
    modules from the front, transitively, no module reached imports torch."""
    graph = {_module_key(p): _module_level_imports(p) for p in PACKAGE.rglob("*.py")}
    front = {m.removeprefix("densa.") for m in FRONT_MODULES}
    seen, stack, offenders = set(), list(front), []
    while stack:
        key = stack.pop()
        if key in seen or key not in graph:
            continue
        seen.add(key)
        for name in graph[key]:
            if name.split(".")[0] in BLOCKED:
                offenders.append(f"densa.{key} imports {name}")
            elif name.startswith("densa."):
                target = name.removeprefix("densa.")
                stack.append(target if target in graph else f"{target}.__init__")
    assert not offenders, "\n".join(sorted(offenders))


# ---- one door into device KV (docs/architecture.md, "The step contract") ---------------------------
def _package_modules() -> list[tuple[str, Path]]:
    """(name, path) of every module of densa and densa_bench, named from its package root."""
    modules = [(f"densa.{_module_key(p)}", p) for p in sorted(PACKAGE.rglob("*.py"))]
    bench = sorted(BENCH_PACKAGE.rglob("*.py"))
    return modules + [(f"densa_bench.{p.relative_to(BENCH_PACKAGE).as_posix()}", p) for p in bench]


def _receiver(node: ast.expr) -> str:
    """The last name of an attribute's receiver: `engine.runner.kv_caches` -> "runner"."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _attribute_uses(path: Path) -> list[ast.Attribute]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)]


def test_no_module_outside_the_worker_holds_device_kv() -> None:
    """Device KV moves through the step (KVLanding in, KVExport out: sched/output.py): outside
    densa/worker no module reads another object's `kv_caches` (a proposer's own, `self`'s, is
    its own), and outside densa/cache nobody reaches into the KV manager's page pool."""
    offenders = []
    for name, path in _package_modules():
        if name.startswith("densa.worker."):
            continue
        for node in _attribute_uses(path):
            owner = _receiver(node.value)
            if node.attr == "kv_caches" and owner != "self":
                offenders.append(f"{name}:{node.lineno} reads {owner}.kv_caches")
            if (
                node.attr == "pool"
                and owner in ("kv", "kv_manager")
                and not name.startswith("densa.cache.")
            ):
                offenders.append(f"{name}:{node.lineno} reaches into {owner}.pool")
    assert not offenders, "\n".join(offenders)


MUTATORS = {"add", "discard", "remove", "append", "appendleft", "extend", "insert", "pop",
            "popleft", "clear", "update", "setdefault", "difference_update"}  # fmt: skip


def test_only_the_scheduler_changes_its_state() -> None:
    """Outside densa/sched, the scheduler's state is changed through its methods only: nobody
    assigns its attributes or mutates its collections (`scheduler.fetching.add(...)`)."""
    offenders = []
    for name, path in _package_modules():
        if name.startswith("densa.sched."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS
                and isinstance(node.func.value, ast.Attribute)
            ):
                targets = [node.func.value]
            for target in targets:
                if isinstance(target, ast.Attribute) and _receiver(target.value) == "scheduler":
                    offenders.append(f"{name}:{node.lineno} changes scheduler.{target.attr}")
    assert not offenders, "\n".join(offenders)


def test_measurement_imports_no_worker_internals() -> None:
    """densa_bench measures densa from outside (LLM, the HTTP server, LLMEngine.observers, the
    formats' own sizes): it imports nothing of densa/worker."""
    offenders = [
        f"densa_bench/{path.relative_to(BENCH_PACKAGE)} imports {name}"
        for path in sorted(BENCH_PACKAGE.rglob("*.py"))
        for name in _imports(path)
        if name == "densa.worker" or name.startswith("densa.worker.")
    ]
    assert not offenders, "\n".join(offenders)


def test_rooms_import_each_other_one_way() -> None:
    """No two rooms (top-level packages) import each other, directly or round a circle, even
    within one layer (ipc and text did): what both need sits in the lower one."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        room = _module_key(path).split(".")[0]
        for name in _imports(path):
            if name.startswith("densa."):
                target = name.split(".")[1]
                if target != room:
                    graph.setdefault(room, set()).add(target)
    circles = sorted({" -> ".join(c) for c in _circles(graph)})
    assert not circles, "\n".join(circles)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each room that lies on one (its rooms, the first repeated last)."""
    found = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], {start}
        while stack:
            room, path = stack.pop()
            for nxt in sorted(graph.get(room, ())):
                if nxt == start:
                    circle = _rotated(path)
                    found.append([*circle, circle[0]])
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    return found


def _rotated(path: list[str]) -> list[str]:
    """The circle started at its smallest room, so each circle is named once."""
    first = path.index(min(path))
    return path[first:] + path[:first]
