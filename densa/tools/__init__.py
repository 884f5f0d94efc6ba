"""Tools that prepare a deployment (not benchmarks: they measure nothing over time).

quantize.py   `densa quantize`: INT4 / FP8 / BF16 checkpoints from HF directories or GGUF files
kv.py         `densa capacity` (what a KV budget holds per KV format) and `densa calibrate-kv`
              (static FP8 KV scales from real text)
"""

from __future__ import annotations

import argparse

from densa.tools.kv import add_kv_parsers
from densa.tools.quantize import add_quantize_parser


def add_tool_parsers(commands: argparse._SubParsersAction) -> None:
    add_quantize_parser(commands)
    add_kv_parsers(commands)


__all__ = ["add_tool_parsers"]
