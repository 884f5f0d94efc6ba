"""Teacher-forced scoring: the model's next-token logits at every position of a given text.

Used by quality evaluation (KL divergence, perplexity, multiple-choice log-likelihoods) to compare
numeric formats. The text runs through the same paged KV path as generation, chunk by chunk, so a
narrow KV cache or quantized weights affect these logits exactly as they affect served tokens.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch

from densa.engine.llm_engine import LLMEngine
from densa.request import Request
from densa.sampling_params import SamplingParams

_ids = itertools.count()


@contextlib.contextmanager
def scoring_request(
    engine: LLMEngine, token_ids: list[int], num_positions: int, kind: str = "score"
) -> Iterator[Request]:
    """A request outside the scheduler holding pages for `num_positions` positions of a text
    that starts with `token_ids`; its pages are freed (and the runner told) on exit."""
    if engine.has_unfinished_requests():
        raise RuntimeError("score with an idle engine: requests are in flight")
    request = Request(f"{kind}-{next(_ids)}", list(token_ids), SamplingParams())
    kv = engine.kv_manager
    if kv.allocate_slots(request, num_positions) is None:
        raise RuntimeError("not enough free KV pages to score this text")
    try:
        yield request
    finally:
        kv.free(request)
        engine.end_scoring(request)  # the freed pages' tags and its end reach the runner


@contextlib.contextmanager
def cached_scoring_request(
    engine: LLMEngine, token_ids: list[int], cache_scope: str, kind: str = "cached"
) -> Iterator[tuple[Request, int]]:
    """Like `scoring_request` for the whole text, but its leading full blocks that the prefix
    cache holds in `cache_scope` are mapped, not allocated: yields (request, number of leading
    tokens whose K/V came from the cache). Positions from there on are the caller's to compute."""
    if engine.has_unfinished_requests():
        raise RuntimeError("score with an idle engine: requests are in flight")
    request = Request(
        f"{kind}-{next(_ids)}", list(token_ids), SamplingParams(), cache_scope=cache_scope
    )
    kv = engine.kv_manager
    hit = kv.find_prefix(request)
    num_hit_tokens = hit.num_tokens(kv.page_size)
    if kv.allocate_slots(request, len(token_ids) - num_hit_tokens, hit) is None:
        kv.forget(request)
        raise RuntimeError("not enough free KV pages to score this text")
    try:
        yield request, num_hit_tokens
    finally:
        kv.free(request)  # the hit pages go back to the cache, still indexed
        kv.forget(request)
        engine.end_scoring(request)


def score_positions(
    engine: LLMEngine, request: Request, token_ids: list[int], start_pos: int
) -> torch.Tensor:
    """Teacher-forced logits [len(token_ids), vocab] fp32 for positions [start_pos, ...) of
    `request` (tokens given here, so continuations can differ from its prompt)."""
    return engine.score(request, token_ids, start_pos)


def iter_logits(
    engine: LLMEngine, token_ids: list[int], chunk_size: int = 512
) -> Iterator[torch.Tensor]:
    """Yield [chunk, vocab] fp32 logits for consecutive chunks of `token_ids`; row i of the whole
    sequence predicts token i + 1. The engine must be idle (no requests in flight)."""
    if not 0 < len(token_ids) <= engine.config.scheduler.max_model_len:
        raise ValueError(f"a scored text must have 1..max_model_len tokens, got {len(token_ids)}")
    with scoring_request(engine, token_ids, len(token_ids)) as request:
        for start in range(0, len(token_ids), chunk_size):
            yield score_positions(engine, request, token_ids[start : start + chunk_size], start)


def token_logprobs(engine: LLMEngine, token_ids: list[int], chunk_size: int = 512) -> torch.Tensor:
    """log p(token_i | tokens_<i) for i = 1..n-1 ([n - 1] fp32)."""
    pieces = []
    targets = torch.tensor(token_ids[1:])
    offset = 0
    for logits in iter_logits(engine, token_ids, chunk_size):
        rows = logits[: len(targets) - offset]  # the last position predicts past the text
        logprobs = torch.log_softmax(rows, dim=-1)
        pieces.append(logprobs.gather(1, targets[offset : offset + len(rows), None]).squeeze(1))
        offset += len(rows)
    return torch.cat(pieces)
