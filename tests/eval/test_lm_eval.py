"""lm-evaluation-harness against `densa serve`: its `local-completions` model scores a
multiple-choice task through /v1/completions with `echo: true, logprobs: 1, max_tokens: 1` (the
prompt's logprobs, SamplingParams.prompt_logprobs), and gets exactly what `densa eval choice`
computes in-process on the same items (densa_bench/eval/choice.py, score_item): the same
log-likelihood for every choice, so the same accuracies.

The task (tests/eval/lm_eval_task/) is a local JSONL file and a task YAML; lm-eval runs as its
own command, as a user runs it, against a real server on the tiny test model. Both of its
request forms are checked: token ids (its default) and text (`tokenized_requests=False`, which
the server tokenizes again).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from densa.engine.llm import LLM
from densa_bench.common.data import ChoiceItem
from densa_bench.eval.choice import score_item
from tests.serve.support import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    RunningServer,
    engine_client,
    running_server,
)

pytest.importorskip("lm_eval", reason="lm-eval is installed by scripts/setup.sh dev")

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = ROOT / "tests" / "eval" / "lm_eval_task"
TASK = "densa_choice"
LM_EVAL_TIMEOUT_S = 300


def _items() -> list[ChoiceItem]:
    """The task's questions as `densa eval choice` reads a task (the YAML's doc_to_text)."""
    rows = [json.loads(line) for line in (TASK_DIR / "choice.jsonl").read_text().splitlines()]
    items = []
    for row in rows:
        context = f"Question: {row['question']}\nAnswer:"
        choices = tuple(row["choices"])
        items.append(ChoiceItem(TASK, row["id"], row["question"], context, choices, row["answer"]))
    return items


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(engine_client(tiny_model_dir)) as running:
        yield running


@pytest.fixture(scope="module")
def densa_scores(tiny_model_dir: Path) -> list[tuple[float, ...]]:
    llm = LLM(model=str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory="64MiB")
    return [score_item(llm, item).logprobs for item in _items()]


# lm-eval's own entry point for a run (its CLI's `run` calls it too, then prints a table with a
# package the dev install leaves out): results and every scored sample, as JSON.
_LM_EVAL = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
model_args, task_dir, task, out = sys.argv[1:]
results = lm_eval.simple_evaluate(
    model="local-completions", model_args=model_args, tasks=[task], batch_size=1,
    task_manager=TaskManager(include_path=task_dir), log_samples=True,
)
body = {"results": results["results"], "samples": results["samples"][task]}
with open(out, "w") as f:
    json.dump(body, f, default=str)
"""


def _run_lm_eval(
    server: RunningServer, model_dir: Path, out: Path, tokenized: bool
) -> dict[str, Any]:
    model_args = ",".join([
        f"model={MODEL_NAME}", f"base_url={server.base_url}/v1/completions",
        f"tokenizer={model_dir}", "tokenizer_backend=huggingface",
        f"tokenized_requests={tokenized}", "num_concurrent=1", "max_retries=1", "timeout=60",
    ])  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out / "datasets"), "TOKENIZERS_PARALLELISM": "false",
           "OPENAI_API_KEY": "unused"}  # fmt: skip
    result = out / "lm_eval.json"
    command = [sys.executable, "-c", _LM_EVAL, model_args, str(TASK_DIR), TASK, str(result)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=LM_EVAL_TIMEOUT_S, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(result.read_text())


@pytest.mark.parametrize("tokenized", [True, False], ids=["token-ids", "text"])
def test_lm_eval_scores_equal_densa_eval_choice(
    served: RunningServer,
    tiny_model_dir: Path,
    densa_scores: list[tuple[float, ...]],
    tmp_path: Path,
    tokenized: bool,
) -> None:
    run = _run_lm_eval(served, tiny_model_dir, tmp_path, tokenized)
    results, samples = run["results"], run["samples"]
    items = _items()
    assert sorted(s["doc"]["id"] for s in samples) == sorted(item.item_id for item in items)
    by_id = {s["doc"]["id"]: s for s in samples}
    accs, accs_norm = [], []
    for item, densa in zip(items, densa_scores, strict=True):
        sample = by_id[item.item_id]
        harness = [float(ll) for ll, _greedy in sample["filtered_resps"]]
        assert harness == pytest.approx(densa, abs=1e-4), item.item_id
        assert sample["acc"] == float(np.argmax(densa) == item.answer_idx)
        # lm-eval normalises by the choice's length without the delimiter.
        lengths = np.array([len(choice) for choice in item.choices], dtype=float)
        assert sample["acc_norm"] == float(np.argmax(np.array(densa) / lengths) == item.answer_idx)
        accs.append(sample["acc"])
        accs_norm.append(sample["acc_norm"])
    task = results[TASK]
    assert task["acc,none"] == pytest.approx(np.mean(accs))
    assert task["acc_norm,none"] == pytest.approx(np.mean(accs_norm))
    served.wait_idle()
