"""Teacher-forced scoring: the model's next-token logits at every position of a given text.

Used by quality evaluation (KL divergence, perplexity, multiple-choice log-likelihoods) to compare
numeric formats. The text runs through the same paged KV path as generation, chunk by chunk, so a
narrow KV cache or quantized weights affect these logits exactly as they affect served tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from densa.engine.llm_engine import LLMEngine
from densa.request import Request
from densa.sampling_params import SamplingParams
from densa.sched.output import ScheduledRequest

_ids = itertools.count()


def iter_logits(
    engine: LLMEngine, token_ids: list[int], chunk_size: int = 512
) -> Iterator[torch.Tensor]:
    """Yield [chunk, vocab] fp32 logits for consecutive chunks of `token_ids`; row i of the whole
    sequence predicts token i + 1. The engine must be idle (no requests in flight)."""
    if engine.has_unfinished_requests():
        raise RuntimeError("score with an idle engine: requests are in flight")
    if not 0 < len(token_ids) <= engine.config.scheduler.max_model_len:
        raise ValueError(f"a scored text must have 1..max_model_len tokens, got {len(token_ids)}")
    request = Request(f"score-{next(_ids)}", list(token_ids), SamplingParams())
    kv = engine.kv_manager
    if kv.allocate_slots(request, len(token_ids)) is None:
        raise RuntimeError("not enough free KV pages to score this text")
    try:
        for start in range(0, len(token_ids), chunk_size):
            chunk = token_ids[start : start + chunk_size]
            item = ScheduledRequest(
                request_id=request.request_id,
                token_ids=chunk,
                start_pos=start,
                page_ids=list(request.page_ids),
                page_tags=list(request.page_tags),
                sample=False,
                sampling_params=request.sampling_params,
            )
            engine.runner.integrity.apply_tag_updates(kv.pool.drain_tag_updates())
            yield engine.runner.score(item)
    finally:
        kv.free(request)


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
