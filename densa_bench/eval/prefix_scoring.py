"""Log-likelihoods of several continuations of one context, computing the context once.

The context's full KV pages are computed once and shared by every continuation, as prefix
caching shares them in serving. The context tokens on its last, partly filled page are computed
again with each continuation, so each continuation writes its page from the page's first slot,
as a fresh page is written in serving. The result equals scoring each context + continuation
whole (tests/eval check this), at a fraction of the work for long contexts.
"""

from __future__ import annotations

import torch

from densa.engine.llm_engine import LLMEngine
from densa.offline.scoring import score_positions, scoring_request
from densa.request import Request


def score_continuations(
    engine: LLMEngine,
    context_ids: list[int],
    continuation_ids: list[list[int]],
    chunk_size: int = 512,
) -> list[float]:
    """sum_t log p(continuation_t | context, continuation_<t) for each continuation (fp32).

    The engine must be idle. Raises ValueError for an empty context or continuation, or one
    longer than the model's context.
    """
    _validate(engine, context_ids, continuation_ids)
    page_size = engine.config.cache.page_size
    # Positions [0, shared_len) are computed once. The last context token is always recomputed
    # with the continuation: its logits predict the continuation's first token.
    shared_len = (len(context_ids) - 1) // page_size * page_size
    longest = len(context_ids) + max(len(c) for c in continuation_ids)
    with scoring_request(engine, context_ids, longest, kind="choice") as request:
        for start in range(0, shared_len, chunk_size):
            end = min(start + chunk_size, shared_len)
            score_positions(engine, request, context_ids[start:end], start)
        tail = context_ids[shared_len:]
        return [
            _score_tail(engine, request, shared_len, tail, c, chunk_size) for c in continuation_ids
        ]


def _validate(engine: LLMEngine, context_ids: list[int], continuation_ids: list[list[int]]) -> None:
    if not context_ids or not continuation_ids or not all(continuation_ids):
        raise ValueError("a context and non-empty continuations are needed")
    longest = len(context_ids) + max(len(c) for c in continuation_ids)
    max_len = engine.config.scheduler.max_model_len
    if longest > max_len:
        raise ValueError(f"context + continuation has {longest} tokens; max_model_len is {max_len}")


def _score_tail(
    engine: LLMEngine,
    request: Request,
    shared_len: int,
    context_tail: list[int],
    continuation: list[int],
    chunk_size: int,
) -> float:
    """Compute positions shared_len.. of context_tail + continuation; sum the continuation's
    log-probabilities.

        tail idx   0 .. first-1 | first .. len(tail)-1
        tokens     context tail | continuation
        row r of the logits predicts tail[r + 1]: rows first-1 .. len(tail)-2 are summed
    """
    tail = context_tail + continuation
    first = len(context_tail)
    total = 0.0
    for start in range(0, len(tail), chunk_size):
        chunk = tail[start : start + chunk_size]
        logits = score_positions(engine, request, chunk, shared_len + start)  # [len(chunk), V]
        lo, hi = max(start, first - 1), min(start + len(chunk), len(tail) - 1)
        if lo < hi:
            logprobs = torch.log_softmax(logits[lo - start : hi - start], dim=-1)
            targets = torch.tensor(tail[lo + 1 : hi + 1])
            total += float(logprobs.gather(1, targets[:, None]).sum())
    return total
