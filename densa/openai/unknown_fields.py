"""Request fields the server does not know: dropped and reported, unless the server is strict.

vLLM, llama-server and Ollama ignore fields they do not know, and frameworks rely on it (they send
their own extensions to every server). So by default densa drops them too -- logging a WARNING
once per field name, and naming them in the `x-densa-ignored-fields` response header -- while
`densa serve --strict-api` refuses them with a 400, as OpenAI does. Only unknown *names* are
forgiven: a known field of the wrong type, size or value is a 400 either way.

Fields are found by validating first: pydantic reports each unknown field (`extra_forbidden`) with
its location, so nested ones (`messages[0].reasoning`) are found as precisely as top-level ones,
and a body without unknown fields is validated once, as before.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from densa.utils.logging import get_logger

logger = get_logger(__name__)

MAX_HEADER_FIELDS = 16  # names in one header; more are counted, not listed
MAX_NAME_CHARS = 64  # a name is cut to this many characters in the header and the log
MAX_LOGGED_NAMES = 1024  # distinct names warned about per process; then one last warning
_INDEX = re.compile(r"\[\d+\]")
_MISSING = object()


def unknown_field_locs(exc: ValidationError) -> list[tuple[Any, ...]]:
    return [tuple(error["loc"]) for error in exc.errors() if error["type"] == "extra_forbidden"]


def drop_fields(data: Any, locs: Sequence[tuple[Any, ...]]) -> list[str]:
    """Delete the fields at `locs` from the parsed JSON body, in place; their names, with list
    indices left out (`messages[].reasoning`), each once, in order. A location that names no
    field of the body (pydantic's own steps, e.g. a union member's name, are skipped) is left."""
    names: list[str] = []
    for loc in locs:
        path = _drop(data, loc, ())
        if path is not None:
            name = _INDEX.sub("[]", _spell(path))
            if name not in names:
                names.append(name)
    return names


def _drop(node: Any, loc: tuple[Any, ...], path: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The path of the field deleted at `loc` under `node`, or None. A string step that is not a
    key here may be a union member's name in pydantic's location: it is tried skipped, too."""
    if not loc:
        return None
    step, rest = loc[0], loc[1:]
    if not rest:
        if isinstance(node, dict) and isinstance(step, str) and step in node:
            del node[step]
            return (*path, step)
        return None
    child = _child(node, step)
    if child is not _MISSING:
        found = _drop(child, rest, (*path, step))
        if found is not None:
            return found
    return _drop(node, rest, path) if isinstance(step, str) else None


def _child(node: Any, step: Any) -> Any:
    if isinstance(node, dict) and isinstance(step, str):
        return node.get(step, _MISSING)
    if isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node):
        return node[step]
    return _MISSING


def _spell(path: tuple[Any, ...]) -> str:
    """("messages", 0, "x") -> "messages[0].x" (OpenAI's spelling of a nested field)."""
    text = ""
    for step in path:
        text += f"[{step}]" if isinstance(step, int) else (f".{step}" if text else str(step))
    return text


def header_value(names: Sequence[str]) -> str:
    """`a,b,c` -- names percent-encoded (a JSON key may hold any character, a header may not),
    cut short, at most MAX_HEADER_FIELDS of them, then `+N` for the rest."""
    shown = [urllib.parse.quote(name[:MAX_NAME_CHARS], safe="[]._-$@:") for name in names]
    value = ",".join(shown[:MAX_HEADER_FIELDS])
    extra = len(shown) - MAX_HEADER_FIELDS
    return f"{value},+{extra}" if extra > 0 else value


class IgnoredFieldLog:
    """Warns once per field name per process: a client sending `foo` on every request is one
    line, not one per request. The names remembered are bounded, so a client inventing a new
    name per request cannot grow memory or flood the log."""

    def __init__(self, max_names: int = MAX_LOGGED_NAMES) -> None:
        self._seen: set[str] = set()
        self._max_names = max_names
        self._full = False

    def note(self, endpoint: str, names: Sequence[str]) -> None:
        for name in names:
            if name in self._seen or self._full:
                continue
            if len(self._seen) == self._max_names:
                self._full = True
                logger.warning("%d unknown fields ignored: naming no more", len(self._seen))
                return
            self._seen.add(name)
            logger.warning(
                "ignored the unknown request field %r on %s (warned once per field; "
                "`densa serve --strict-api` refuses unknown fields)",
                name[:MAX_NAME_CHARS],
                endpoint,
            )
