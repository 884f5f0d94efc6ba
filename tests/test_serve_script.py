"""scripts/serve.sh, the documented way to start densa, serves with INT8 KV pages
(docs/kv-cache.md: "The default"), and a --kv-cache-dtype given to the script still wins."""

from __future__ import annotations

import shlex
from pathlib import Path

from densa.bench.peer_specs import SERVE_SH_ARGS
from densa.cli import build_parser

SERVE_SH = Path(__file__).resolve().parents[1] / "scripts" / "serve.sh"


def _script_serve_args() -> list[str]:
    """The arguments the script's `exec ... densa serve ARGS "$@"` line puts before the user's."""
    (line,) = [ln for ln in SERVE_SH.read_text().splitlines() if ln.startswith("exec ")]
    words = shlex.split(line)
    assert words[-1] == "$@" and words[1].endswith("/.venv/bin/densa"), line
    return words[2:-1]


def test_serve_script_picks_int8_kv_and_the_user_can_override_it() -> None:
    args = _script_serve_args()
    assert args[0] == "serve"
    assert build_parser().parse_args(args).kv_cache_dtype == "int8"
    assert args[1:] == SERVE_SH_ARGS  # `densa bench peers` runs "densa (default)" with these
    user = [*args, "--kv-cache-dtype", "bfloat16"]
    assert build_parser().parse_args(user).kv_cache_dtype == "bfloat16"
