"""One benchmark as `densa bench` sees it, and its command-line options written once.

A benchmark declares a settings dataclass whose fields carry their own option (help, flag,
choices: `option(...)` in the field's metadata); `add_options` turns those fields into argparse
options, with the type and default the field already states, and `settings_from` turns the
parsed options back into the dataclass (whose `__post_init__` says what is invalid). The
declaration (`Benchmark`) lives in the benchmark's `settings.py`, which imports no torch: the
parser is built for every `densa` command, the runner is imported only when the benchmark runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

S = TypeVar("S")
BENCH_KV_CACHE_MEMORY = "2GiB"  # fixed, not a fraction of free memory: runs stay comparable
BENCHMARK_GROUP = "benchmark"


@dataclass(frozen=True)
class Option:
    """How one settings field appears on the command line (the field's metadata)."""

    help: str | None = None
    flag: str | None = None  # default: --field-name
    choices: tuple[Any, ...] | None = None
    group: str = BENCHMARK_GROUP  # the argument group's title
    negate: bool = False  # a bool field that a store-true flag sets False (--skip-hf: include_hf)
    toggle: bool = False  # a bool field with --flag / --no-flag


def option(default: Any, help: str | None = None, **how: Any) -> Any:
    """A settings field with its default and its command-line option."""
    return field(default=default, metadata={"option": Option(help, **how)})


class Benchmark(Protocol):
    """What `densa bench NAME` needs from a benchmark: its name, its settings dataclass (the
    options), its sub-command, and a run from settings (plus the parsed command line, for
    EngineArgs and --out) to an exit status."""

    @property
    def name(self) -> str: ...

    @property
    def settings(self) -> type: ...

    def add_to(self, benchmarks: argparse._SubParsersAction) -> None: ...

    def run(self, settings: Any, ns: argparse.Namespace) -> int: ...


@dataclass(frozen=True)
class BenchmarkCommand(Generic[S]):
    """The usual benchmark: options from `settings`, `--out`, EngineArgs' options unless
    `engine_defaults` is None (a benchmark that starts its own engines sets what it fixes, such
    as the KV budget), and a run. The run is `runner`, "module:function" imported only then (it
    imports torch), called with the settings and the EngineArgs; its report is written to --out.
    A benchmark that needs more of the command line gives `run_with(settings, ns) -> status`."""

    name: str
    help: str
    description: str
    settings: type[S]
    out: Path
    runner: str = ""
    run_with: Callable[[S, argparse.Namespace], int] | None = None
    engine_defaults: Mapping[str, Any] | None = field(default_factory=dict)
    extra_options: Callable[[argparse._ArgumentGroup], None] | None = None

    def add_to(self, benchmarks: argparse._SubParsersAction) -> None:
        parser = benchmarks.add_parser(self.name, help=self.help, description=self.description)
        group = add_options(parser, self.settings)
        if self.extra_options is not None:
            self.extra_options(group)
        group.add_argument("--out", type=Path, default=self.out, help="folder")
        if self.engine_defaults is not None:
            from densa.setup.args import EngineArgs

            EngineArgs.add_cli_args(parser)
        parser.set_defaults(
            handler=self.handle, benchmark=self.name, **(self.engine_defaults or {})
        )

    def handle(self, ns: argparse.Namespace) -> int:
        try:
            settings = settings_from(ns, self.settings)
        except ValueError as exc:
            print(f"densa bench {self.name}: {exc}", file=sys.stderr)
            return 2
        return self.run(settings, ns)

    def run(self, settings: S, ns: argparse.Namespace) -> int:
        if self.run_with is not None:
            return self.run_with(settings, ns)
        from densa.setup.args import EngineArgs

        module, _, function = self.runner.partition(":")
        run = getattr(importlib.import_module(module), function)
        return write_report(run(settings, EngineArgs.from_cli(ns)), ns.out)


def write_report(report: Any, out: Path) -> int:
    """Write a BenchReport's files, print its tables and where they went; exit status 0."""
    paths = report.write(out)
    for table in report.tables:
        print(table.to_markdown() + "\n")
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


# ---- settings dataclass <-> options -----------------------------------------------------------
def add_options(parser: argparse.ArgumentParser, settings: type) -> argparse._ArgumentGroup:
    """One option per field that declares one, in field order, in its group; returns the
    benchmark group (created first, so it leads the help as before)."""
    groups = {BENCHMARK_GROUP: parser.add_argument_group(BENCHMARK_GROUP)}
    hints = typing.get_type_hints(settings)
    for item in _option_fields(settings):
        how: Option = item.metadata["option"]
        if how.group not in groups:
            groups[how.group] = parser.add_argument_group(how.group)
        flag = how.flag or "--" + item.name.replace("_", "-")
        groups[how.group].add_argument(flag, **_argparse_kwargs(how, hints[item.name], item))
    return groups[BENCHMARK_GROUP]


def settings_from(ns: argparse.Namespace, settings: type[S]) -> S:
    """The settings dataclass from parsed options (lists become tuples; None keeps the
    field's default)."""
    values = {}
    for item in _option_fields(settings):
        value = getattr(ns, _dest(item))
        if isinstance(value, list):
            value = tuple(value)
        if item.metadata["option"].negate:
            value = not value
        if value is not None:
            values[item.name] = value
    return settings(**values)


def _option_fields(settings: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(settings) if "option" in f.metadata]


def _dest(item: dataclasses.Field[Any]) -> str:
    """The namespace attribute: the flag's name (as argparse derives it), so `ns.skip_hf`,
    `ns.plan_seed` read as the options do."""
    how: Option = item.metadata["option"]
    return (how.flag or item.name).lstrip("-").replace("-", "_")


def _argparse_kwargs(how: Option, hint: Any, item: dataclasses.Field[Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"help": how.help, "dest": _dest(item), "default": item.default}
    if how.choices is not None:
        kwargs["choices"] = list(how.choices)
    if how.negate:
        return {**kwargs, "action": "store_true", "default": False}
    if how.toggle:
        return {**kwargs, "action": argparse.BooleanOptionalAction}
    base, many = _unwrap(hint)
    if many:
        kwargs.update(nargs="+", default=list(kwargs["default"]))
    if base is not str:
        kwargs["type"] = base
    return kwargs


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """(element type, whether the field is a tuple of them) of `X`, `X | None`, `tuple[X, ...]`."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    return hint, False
