"""What the engine reports per request per step (plain data; the HTTP layer formats it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from densa.worker.sampler import TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # tokens produced since the last output of this request
    new_text: str  # text released since the last output (stop-string prefixes held back)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # set when finish_reason == "error"
    error_code: str | None = None  # machine-readable, e.g. "kv_integrity_violation"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    # Filled on the final output only (offline API convenience): the whole generation.
    text: str | None = None
    token_ids: list[int] | None = None
