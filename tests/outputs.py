"""Engine-level tests see token deltas (ipc.RequestDelta); this gathers them per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from densa.ipc.messages import RequestDelta


@dataclass
class Final:
    """A finished request: every token it produced and how it ended."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None
    error: str | None
    error_code: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass
class Collector:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finals: dict[str, Final] = field(default_factory=dict)

    def add(self, deltas: list[RequestDelta]) -> list[Final]:
        """Take in one step's deltas; returns the requests that finished in it."""
        done = []
        for delta in deltas:
            tokens = self.tokens.setdefault(delta.request_id, [])
            tokens.extend(delta.new_token_ids)
            if delta.finished:
                final = Final(delta.request_id, list(tokens), delta.finish_reason, delta.error,
                              delta.error_code, delta.num_prompt_tokens, delta.num_cached_tokens)  # fmt: skip
                self.finals[delta.request_id] = final
                done.append(final)
        return done
