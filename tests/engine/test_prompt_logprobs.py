"""Prompt logprobs (SamplingParams.prompt_logprobs, what `echo` reports): computed from the rows of
the prefill that runs anyway, they equal teacher-forced scoring of the same tokens (the path
`densa eval choice` scores with), whatever the chunking, the prefix cache or a preemption.

A prefix hit would skip the positions whose logits are needed, so such a request never maps the
prefix cache (it reports no cached tokens), while its own pages are still indexed for others.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from densa.engine.llm_engine import LLMEngine
from densa.engine.tracking import Tracked
from densa.ipc.messages import TokenLogprobs
from densa.offline.scoring import iter_logits
from densa.request import Request
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from densa.worker import prompt_logprobs

PAGE_SIZE = 4


def _engine(model_dir: Path, **overrides: object) -> LLMEngine:
    settings: dict[str, object] = dict(model=str(model_dir), max_model_len=64, num_kv_pages=64,
                                       page_size=PAGE_SIZE, max_num_batched_tokens=512)  # fmt: skip
    settings.update(overrides)
    return LLMEngine.from_args(EngineArgs(**settings))  # type: ignore[arg-type]


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (length,), generator=gen).tolist()


def _run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, dict]:
    """Step until every request ends: per request id, its prompt logprobs, tokens, cached count."""
    ids = [engine.add_request(tokens, params) for tokens, params in requests]
    out: dict[str, dict] = {i: {"prompt": [], "tokens": [], "deltas": 0} for i in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            seen = out[delta.request_id]
            if delta.prompt_logprobs:
                assert seen["deltas"] == 0, "prompt logprobs come whole, in the first delta"
            seen["prompt"] += delta.prompt_logprobs
            seen["tokens"] += delta.new_token_ids
            seen["deltas"] += 1
            seen["cached"] = delta.num_cached_tokens
        engine.check_invariants()
    return {i: out[i] for i in ids}


def _reference(engine: LLMEngine, tokens: list[int], num_top: int) -> list[TokenLogprobs]:
    """Teacher-forced: log_softmax of offline scoring's logits (engine idle)."""
    rows = torch.log_softmax(torch.cat(list(iter_logits(engine, tokens))), dim=-1)
    entries = []
    for position, token_id in enumerate(tokens[1:], start=1):
        row = rows[position - 1]
        top = torch.topk(row, num_top) if num_top else None
        pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else []
        entries.append(TokenLogprobs(token_id, float(row[token_id]), pairs))
    return entries


def _assert_close(got: list[TokenLogprobs], want: list[TokenLogprobs]) -> None:
    assert [e.token_id for e in got] == [e.token_id for e in want]
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-4)
    for g, w in zip(got, want, strict=True):
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-4)


@pytest.mark.parametrize("budget", [512, 7])  # one prefill chunk; chunks of 7 across pages
def test_prompt_logprobs_equal_teacher_forced_scores(tiny_model_dir: Path, budget: int) -> None:
    engine = _engine(tiny_model_dir, max_num_batched_tokens=budget)
    prompt = _prompt(37, seed=1)
    other = _prompt(20, seed=2)  # shares the steps, asks for nothing
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3, logprobs=1)
    results = _run(engine, [(prompt, params), (other, SamplingParams(max_tokens=3))])
    mine, theirs = results.values()
    assert len(mine["prompt"]) == len(prompt) - 1  # token 0 has none
    _assert_close(mine["prompt"], _reference(engine, prompt, 3))
    assert len(mine["tokens"]) == 3
    assert theirs["prompt"] == []


def test_a_cached_prompt_is_computed_again_for_its_logprobs(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    prompt = _prompt(30, seed=3)
    first = _run(engine, [(prompt, SamplingParams(max_tokens=1))])
    assert next(iter(first.values()))["cached"] == 0
    again = _run(engine, [(prompt, SamplingParams(max_tokens=1))])
    assert next(iter(again.values()))["cached"] == 28  # the prompt's full pages (7 x 4 tokens)
    echo = _run(engine, [(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))])
    result = next(iter(echo.values()))
    assert result["cached"] == 0
    _assert_close(result["prompt"], _reference(engine, prompt, 0))
    # Its own pages were indexed: the next plain request hits them.
    after = _run(engine, [(prompt, SamplingParams(max_tokens=1))])
    assert next(iter(after.values()))["cached"] == 28


def test_a_preempted_prompt_reports_each_token_once(tiny_model_dir: Path) -> None:
    # 16 pages hold one 64-token context: two long prompts cannot both stay, the newer one is
    # preempted mid-prefill (some of its logprobs computed) and recomputed from its first token.
    engine = _engine(tiny_model_dir, num_kv_pages=16, max_num_batched_tokens=12)
    older, newer = _prompt(40, seed=4), _prompt(41, seed=5)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    results = _run(engine, [(older, params), (newer, params)])
    assert engine.scheduler.num_preemptions > 0
    for prompt, result in zip((older, newer), results.values(), strict=True):
        _assert_close(result["prompt"], _reference(engine, prompt, 1))


def test_no_block_of_prompt_rows_exceeds_its_size(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, max_model_len=256, num_kv_pages=80)
    head = engine.runner.model.compute_logits
    head_rows: list[int] = []

    def counted(hidden: torch.Tensor) -> torch.Tensor:
        head_rows.append(hidden.shape[0])
        return head(hidden)

    engine.runner.model.compute_logits = counted  # type: ignore[method-assign]
    prompt = _prompt(200, seed=6)
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    (result,) = _run(engine, [(prompt, params)]).values()
    assert max(head_rows) == prompt_logprobs.PROMPT_ROWS_AT_ONCE
    assert sum(head_rows) == len(prompt) - 1 + 1  # every prompt row once, and the sampled row
    assert len(result["prompt"]) == len(prompt) - 1


def test_recomputed_logprobs_are_kept_once() -> None:
    tracked = Tracked(Request("r", [1, 2, 3, 4, 5], SamplingParams(prompt_logprobs=0)))
    entry = [TokenLogprobs(t, -float(t), []) for t in range(6)]
    tracked.take_prompt_logprobs(1, entry[1:3])  # tokens 1, 2
    tracked.take_prompt_logprobs(1, entry[1:4])  # recomputed from the start: 1, 2 again, then 3
    tracked.take_prompt_logprobs(4, entry[4:5])
    assert [e.token_id for e in tracked.prompt_logprobs] == [1, 2, 3, 4]
