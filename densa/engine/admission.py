"""Admission: whether a request can ever run on this engine, checked before it is queued (a
request that could not would otherwise fail inside a step, where it is harder to pin on it)."""

from __future__ import annotations

from densa.sampling_params import SamplingParams


class PromptTooLong(ValueError):
    """The prompt leaves no room for output in the model's context (context_length_exceeded)."""


def check_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    vocab: int,
    max_len: int,
    has_grammars: bool,
) -> None:
    """Raise ValueError if the request can never run: an empty prompt, token ids outside the
    vocabulary, a prompt that fills the context, a structured request without a grammar
    compiler. Pure: safe to call from any thread."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    if params.structured is not None and not has_grammars:
        raise ValueError("this engine was built without a grammar compiler")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids out of range [0, {vocab}): {bad[:5]}")
    if len(prompt_token_ids) >= max_len:
        raise PromptTooLong(
            f"the prompt has {len(prompt_token_ids)} tokens but this model's context is "
            f"{max_len} tokens (prompt + at least one output token); shorten the prompt"
        )
    bad_stop = [t for t in params.stop_token_ids if t >= vocab]
    if bad_stop:
        raise ValueError(f"stop_token_ids out of range [0, {vocab}): {bad_stop[:5]}")
    bad_bias = [t for t, _ in params.logit_bias if t >= vocab]
    if bad_bias:
        raise ValueError(f"logit_bias token ids out of range [0, {vocab}): {bad_bias[:5]}")
