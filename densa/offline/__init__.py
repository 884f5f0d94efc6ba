"""Offline work on a model, outside serving: preparing a deployment and scoring text.

Not benchmarks (they measure nothing over time), and not the engine loop (they drive it).

quantize.py        `densa quantize`: INT4 / FP8 / BF16 checkpoints from HF directories or GGUF files
kv.py              `densa capacity` (what a KV budget holds per KV format) and `densa calibrate-kv`
deployment.py      the capacity arithmetic of a deployment, from a config.json alone
kv_calibration.py  static FP8 KV scales from real text
scoring.py         teacher-forced scoring: the model's logits at every position of a text
inproc_pair.py     a prefill and a decode engine in one process (quality of the split)
"""

from __future__ import annotations

import argparse

from densa.offline.kv import add_kv_parsers
from densa.offline.quantize import add_quantize_parser


def add_tool_parsers(commands: argparse._SubParsersAction) -> None:
    add_quantize_parser(commands)
    add_kv_parsers(commands)


__all__ = ["add_tool_parsers"]
