"""Numeric formats under comparison, each given as `EngineArgs` overrides.

A format spec is `key=value,key=value` over EngineArgs fields, optionally with a label first:

    kv_cache_dtype=fp8_e4m3
    int4:model=/ckpt/smollm2-int4-g128,kv_cache_dtype=bfloat16

Values are converted to the field's type (int, float, bool, str; `none` for optional fields).
The overrides apply on top of one base EngineArgs shared by every format, so formats differ
only in what their specs say.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from densa.setup.args import EngineArgs

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"none", "null"}


@dataclass(frozen=True)
class Format:
    """One configuration under test: a label for reports and the engine options it runs with."""

    label: str
    args: EngineArgs
    overrides: dict[str, Any] = field(default_factory=dict)


def parse_format(spec: str, base: EngineArgs) -> Format:
    """`[label:]key=value,...` -> a Format whose args are `base` with those fields replaced.

    The label defaults to the spec itself, or `base` for an empty spec. Raises ValueError with
    the valid keys for an unknown key, and with the expected type for a bad value.
    """
    label, body = _split_label(spec.strip())
    overrides = parse_overrides(body)
    return Format(
        label=label or body or "base",
        args=dataclasses.replace(base, **overrides),
        overrides=overrides,
    )


def _split_label(spec: str) -> tuple[str | None, str]:
    """'int4:model=/a:b' -> ('int4', 'model=/a:b'): a label is a ':' before the first '='."""
    colon, equals = spec.find(":"), spec.find("=")
    if colon != -1 and (equals == -1 or colon < equals):
        return spec[:colon].strip(), spec[colon + 1 :].strip()
    return None, spec


def parse_overrides(body: str) -> dict[str, Any]:
    """'a=1,b=x' -> {'a': 1, 'b': 'x'} with values converted to EngineArgs field types."""
    hints = _field_types()
    overrides: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in body.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"format option {item!r} is not key=value")
        if key not in hints:
            raise ValueError(
                f"unknown format option {key!r}; EngineArgs fields are: {', '.join(sorted(hints))}"
            )
        overrides[key] = convert_value(key, raw.strip(), hints[key])
    return overrides


def _field_types() -> dict[str, Any]:
    # EngineArgs uses postponed annotations: resolve the strings into real types.
    hints = typing.get_type_hints(EngineArgs)
    return {f.name: hints[f.name] for f in dataclasses.fields(EngineArgs)}


def convert_value(key: str, raw: str, hint: Any) -> Any:
    """Convert `raw` to the type `hint` (X, or X | None)."""
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    is_optional = type(None) in members
    if is_optional and raw.lower() in _NONE:
        return None
    (target,) = [m for m in members if m is not type(None)]
    try:
        return _convert(raw, target)
    except ValueError:
        kind = f"{target.__name__} or none" if is_optional else target.__name__
        raise ValueError(f"format option {key}={raw!r}: expected {kind}") from None


def _convert(raw: str, target: type) -> Any:
    if target is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(raw)
    return target(raw)  # int, float and str parse their own text


def split_options(formats: Sequence[Format]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(options every format shares, per format the options where formats differ): what a
    report needs to say exactly what ran, without repeating every option per format."""
    options = [vars(fmt.args) for fmt in formats]
    common = {k: v for k, v in options[0].items() if all(o[k] == v for o in options)}
    differing = [{k: v for k, v in o.items() if k not in common} for o in options]
    return common, differing
