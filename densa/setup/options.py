"""How an engine option is declared: once, as an EngineArgs field made by `option(...)`. Its
metadata says how the command line shows it (help, choices, flag) and which frozen config fields
it becomes (`to`); the value's type comes from the field's annotation. From those fields this
module builds the argparse options (`densa serve`, `densa generate`, bench, eval), reads a parsed
command line back, and gathers each config section's values, so no option is listed twice."""

from __future__ import annotations

import argparse
from dataclasses import Field, dataclass, field, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

OPTION = "densa.option"  # the metadata key of an EngineArgs field's Option
ENGINE = "engine"  # a `to` section: a field of EngineConfig itself, not of a sub-config


@dataclass(frozen=True)
class Option:
    """One engine option: its command line and the config fields it lands in."""

    # "section" (the config field of the same name) or "section.name", per config field it sets:
    # sections are EngineConfig's fields (model, cache, ...), or ENGINE for EngineConfig's own.
    to: tuple[str, ...]
    help: str | None = None
    choices: tuple[str, ...] | None = None
    flag: str | None = None  # None: --field-name
    metavar: str | None = None
    # Booleans: toggle = --x / --no-x, store_true = --x only, on-off = `--x on|off`.
    switch: Literal["toggle", "store_true", "on-off"] = "toggle"
    # "+": one or more values, of which the field keeps the first (the caller may read the rest).
    nargs: Literal["+"] | None = None

    def flag_for(self, name: str) -> str:
        return self.flag or "--" + name.replace("_", "-")

    def config_names(self, name: str, section: str) -> list[str]:
        """The fields of config `section` this option (EngineArgs field `name`) sets."""
        return [
            target.partition(".")[2] or name
            for target in self.to
            if target.partition(".")[0] == section
        ]


def option(
    default: Any,
    to: str | tuple[str, ...],
    *,
    help: str | None = None,  # argparse's own word
    choices: tuple[str, ...] | None = None,
    flag: str | None = None,
    metavar: str | None = None,
    switch: Literal["toggle", "store_true", "on-off"] = "toggle",
    nargs: Literal["+"] | None = None,
) -> Any:
    """An EngineArgs field with its option (see Option for the arguments)."""
    spec = Option((to,) if isinstance(to, str) else to, help, choices, flag, metavar, switch, nargs)
    return field(default=default, metadata={OPTION: spec})


def option_of(f: Field[Any]) -> Option:
    spec = f.metadata.get(OPTION)
    if not isinstance(spec, Option):
        raise TypeError(f"EngineArgs.{f.name} is not declared with option(...)")
    return spec


# ---- the command line --------------------------------------------------------------------------
def add_engine_options(parser: argparse.ArgumentParser, args_class: type) -> None:
    """Every field of `args_class` (EngineArgs) as an option of one "engine" group, in field order,
    with the field's default."""
    group = parser.add_argument_group("engine")
    hints = get_type_hints(args_class)
    for f in fields(args_class):
        spec = option_of(f)
        group.add_argument(spec.flag_for(f.name), dest=f.name, **_argparse_kwargs(f, spec, hints))


def _argparse_kwargs(f: Field[Any], spec: Option, hints: dict[str, Any]) -> dict[str, Any]:
    hint = hints[f.name]
    kwargs: dict[str, Any] = {"default": f.default, "help": spec.help}
    if hint is bool:
        if spec.switch == "on-off":
            return {**kwargs, "choices": ["on", "off"], "default": "on" if f.default else "off"}
        action = "store_true" if spec.switch == "store_true" else argparse.BooleanOptionalAction
        return {**kwargs, "action": action}
    if get_origin(hint) is tuple:  # repeatable, in order; argparse's append needs a None default
        return {**kwargs, "action": "append", "default": None, "metavar": spec.metavar}
    value_type = next(t for t in (*get_args(hint), hint) if t is not type(None))  # int | None: int
    if value_type in (int, float):
        kwargs["type"] = value_type
    if spec.choices is not None:
        kwargs["choices"] = list(spec.choices)
    if spec.metavar is not None:
        kwargs["metavar"] = spec.metavar
    if spec.nargs is not None:
        kwargs["nargs"] = spec.nargs
    return kwargs


def parsed_values(args_class: type, ns: argparse.Namespace) -> dict[str, Any]:
    """The fields of `args_class` a parsed command line holds, as the fields' values."""
    hints = get_type_hints(args_class)
    values = {}
    for f in fields(args_class):
        if not hasattr(ns, f.name):
            continue
        value, spec = getattr(ns, f.name), option_of(f)
        if hints[f.name] is bool and spec.switch == "on-off":
            value = value == "on"
        elif get_origin(hints[f.name]) is tuple:
            value = tuple(value or ())
        elif spec.nargs == "+" and isinstance(value, list):
            value = value[0]
        values[f.name] = value
    return values


# ---- the frozen config -------------------------------------------------------------------------
def config_values(args: Any, section: str, **resolved: Any) -> dict[str, Any]:
    """The keyword arguments of config `section` that the options of `args` (an EngineArgs) set:
    each option's value, or the value `resolved` gives for it (by field name: "auto" resolved
    against the model), under every name its `to` gives in that section."""
    values = {}
    for f in fields(args):
        for name in option_of(f).config_names(f.name, section):
            values[name] = resolved[f.name] if f.name in resolved else getattr(args, f.name)
    return values
