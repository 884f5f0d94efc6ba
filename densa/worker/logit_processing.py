"""Logits processing shared by plain sampling and verification, row by row from each request's
params: penalties, logit bias, min_tokens, temperature with top-k / top-p / min-p, and the check
for rows with nothing finite to choose from."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from densa.worker.sampler import SampleRequest


def sampling_probs(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    """Temperature, top-k, top-p, softmax, min-p: what a random row draws from (min-p zeroes
    tokens without renormalising; the exponential race does not need it)."""
    temperatures = torch.tensor([r.params.temperature for r in rows]).unsqueeze(1)
    logits = filter_top_k(logits / temperatures, rows)
    logits = filter_top_p(logits, rows)
    probs = torch.softmax(logits, dim=-1)
    return filter_min_p(probs, rows)


def non_finite_rows(logits: torch.Tensor, reason: str) -> dict[int, str]:
    """Rows with a NaN or +inf (softmax turns either into NaN), or with no finite logit at all
    (nothing to choose from). -inf alone is normal: it is how tokens are masked.

    One reduction finds all three: a row's max is NaN if it holds a NaN (amax propagates it),
    +inf if it holds +inf, -inf if nothing in it is finite, and finite otherwise. (Four
    elementwise passes over [N, vocab] did the same at 6x the cost of the whole greedy sample
    of a 5-row verification, with [N, vocab] masks of ~10 MB each at 64 rows.)"""
    bad = ~torch.isfinite(torch.amax(logits, dim=-1))
    if not bool(bad.any()):  # the common case: one reduction, one check
        return {}
    return {int(i): reason for i in bad.nonzero().flatten().tolist()}


def apply_penalties(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    penalized = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not penalized:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in penalized:
        params = rows[i].params
        output_counts = torch.bincount(
            torch.tensor(rows[i].output_token_ids, dtype=torch.long), minlength=vocab
        )
        row = logits[i]
        if params.repetition_penalty != 1.0:
            seen = output_counts > 0
            seen[torch.tensor(rows[i].prompt_token_ids, dtype=torch.long)] = True
            # CTRL-style: shrink positive logits, grow negative ones, for every token already seen.
            penalized_row = torch.where(
                row > 0, row / params.repetition_penalty, row * params.repetition_penalty
            )
            row = torch.where(seen[:vocab], penalized_row, row)
        row = row - params.frequency_penalty * output_counts[:vocab].to(row.dtype)
        row = row - params.presence_penalty * (output_counts[:vocab] > 0).to(row.dtype)
        logits[i] = row
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return logits
    logits = logits.clone()
    for i in biased:
        pairs = [(t, b) for t, b in rows[i].params.logit_bias if t < logits.shape[1]]
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=logits.device)
        bias = torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)
        logits[i] = logits[i].index_add(0, ids, bias)
    return logits


def apply_min_tokens(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    blocked = [(i, r) for i, r in enumerate(rows) if len(r.output_token_ids) < r.params.min_tokens]
    if not blocked:
        return logits
    logits = logits.clone()
    for i, r in blocked:
        ids = [t for t in r.ending_token_ids if t < logits.shape[1]]
        if not ids:
            continue
        blocked_row = logits[i].index_fill(0, torch.tensor(ids), float("-inf"))
        # A grammar that allows only EOS wins over min_tokens: a row of -inf has no token.
        if not bool(torch.isneginf(blocked_row).all()):
            logits[i] = blocked_row
    return logits


def filter_top_k(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    vocab = logits.shape[1]
    ks = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    if all(k == vocab for k in ks):
        return logits
    kth = torch.topk(logits, max(ks), dim=-1).values  # [N, max_k], descending
    threshold = kth.gather(1, torch.tensor(ks).unsqueeze(1) - 1)  # [N, 1]: the k-th largest
    return logits.masked_fill(logits < threshold, float("-inf"))


def filter_top_p(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    top_p = torch.tensor([r.params.top_p for r in rows]).unsqueeze(1)
    if bool((top_p >= 1.0).all()):
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens before it already reach top_p. The most likely token is always
    # kept, even when top_p underflows float32 (1e-300 is 0 here, and 0 >= 0 would drop it).
    drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filter_min_p(probs: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    min_p = torch.tensor([r.params.min_p for r in rows]).unsqueeze(1)
    if bool((min_p <= 0.0).all()):
        return probs
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return probs.masked_fill(probs < threshold, 0.0)
