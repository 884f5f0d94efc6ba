"""Prompt logprobs (`echo` with `logprobs`): log p(prompt_i | prompt_<i) for the prompt positions
a step computes, read from the rows of the forward pass that computes them anyway.

A chunk of positions [start_pos, end_pos) of a prompt of P tokens gives, from its row at position
p, the logprob of the prompt token at p + 1:

    position    start_pos ... end_pos - 1          (end_pos <= P)
    row predicts prompt[start_pos + 1] ... prompt[end_pos]
    kept        rows whose target is a prompt token: p + 1 <= P - 1

so the row at P - 1 (the one the sampler reads for the first output token) is not a prompt
logprob, and prompt token 0 has none (nothing predicts it). Chunks of one prompt cover positions
1 .. P - 1 exactly once, in order.

Memory: a row of logits is vocab x 4 bytes (0.6 MB for a 150k vocabulary), so the rows are taken
PROMPT_ROWS_AT_ONCE at a time through the output head, log-softmax and top-N, and only the
chosen token's logprob and the top N survive a block: a 4k-token prompt never holds [4k, vocab].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from densa.ipc.messages import TokenLogprobs
from densa.model.interface import CausalLM
from densa.sched.mirror import ScheduledRequest

# Rows of logits alive at once ([32, 151936] float32 is 19 MB, as much again for the
# log-softmax). The output head reads its weights once per call, so fewer, larger blocks are
# cheaper; this keeps a block near the size of the sampler's (LOGITS_ROWS_AT_ONCE).
PROMPT_ROWS_AT_ONCE = 32


@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of prompt tokens first_idx, first_idx + 1, ... (one entry each, in order)."""

    first_idx: int
    entries: list[TokenLogprobs]


def prompt_rows(item: ScheduledRequest) -> range:
    """The positions of `item`'s chunk whose rows give a prompt logprob (empty unless the request
    asks for them and has no output yet: a recompute after its first token needs none)."""
    num_prompt = len(item.prompt_token_ids)
    if item.sampling_params.prompt_logprobs is None or item.output_token_ids:
        return range(0)
    return range(item.start_pos, min(item.end_pos, num_prompt - 1))


def compute_prompt_logprobs(
    model: CausalLM, order: list[ScheduledRequest], hidden: torch.Tensor
) -> dict[str, PromptLogprobs]:
    """The prompt logprobs of every request in `order` that wants them; hidden: [T, hidden], the
    pass's final hidden states, rows in `order` (each request's chunk, in turn)."""
    results: dict[str, PromptLogprobs] = {}
    row = 0
    for item in order:
        positions = prompt_rows(item)
        if positions:
            first_row = row + positions.start - item.start_pos
            targets = item.prompt_token_ids[positions.start + 1 : positions.stop + 1]
            rows = hidden[first_row : first_row + len(positions)]  # [n, hidden]
            num_top = item.sampling_params.prompt_logprobs or 0
            entries = _logprobs(model, rows, targets, num_top)
            results[item.request_id] = PromptLogprobs(positions.start + 1, entries)
        row += item.num_tokens
    return results


def _logprobs(
    model: CausalLM, rows: torch.Tensor, targets: list[int], num_top: int
) -> list[TokenLogprobs]:
    """Row i of `rows` predicts targets[i]: its logprob and the num_top most likely tokens."""
    entries: list[TokenLogprobs] = []
    for start in range(0, len(targets), PROMPT_ROWS_AT_ONCE):
        block = targets[start : start + PROMPT_ROWS_AT_ONCE]
        logits = model.compute_logits(rows[start : start + len(block)])  # [b, vocab] fp32
        logprobs = torch.log_softmax(logits, dim=-1)
        index = torch.tensor(block, device=logprobs.device)[:, None]
        chosen = logprobs.gather(1, index).squeeze(1).tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in block]
        if num_top:
            top = torch.topk(logprobs, num_top, dim=-1)
            ids, values = top.indices.tolist(), top.values.tolist()
            tops = [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]
        del logits, logprobs
        entries.extend(
            TokenLogprobs(t, lp, top) for t, lp, top in zip(block, chosen, tops, strict=True)
        )
    return entries
