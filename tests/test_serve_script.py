"""scripts/serve.sh, the documented way to start densa, serves with INT8 KV pages
(docs/kv-cache.md: "The default") on the real 1.5B model, and a --kv-cache-dtype or --model given to
the script still wins."""

from __future__ import annotations

import shlex
from pathlib import Path

from densa.cli import build_parser
from densa_bench.peers.specs import SERVE_SH_ARGS

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
    parsed = build_parser().parse_args(args)
    assert parsed.kv_cache_dtype == "int8"
    assert parsed.model == "qwen2.5-coder-1.5b"  # the real model, by its catalog name
    # `densa bench peers` runs "densa (default)" with the same flags on the file it is given
    assert args[1:3] == ["--model", "qwen2.5-coder-1.5b"] and args[3:] == SERVE_SH_ARGS
    user = [*args, "--kv-cache-dtype", "bfloat16", "--model", "smollm2-135m"]
    assert build_parser().parse_args(user).kv_cache_dtype == "bfloat16"
    assert build_parser().parse_args(user).model == "smollm2-135m"
