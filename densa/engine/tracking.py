"""What the engine keeps of each request beside the scheduler's record: what is not reported yet,
and the RequestDelta that reports it."""

from __future__ import annotations

from dataclasses import dataclass, field

from densa.ipc.messages import RequestDelta, TokenLogprobs
from densa.request import Request


@dataclass
class Tracked:
    """Engine-side state of one request: its scheduler record plus what is not yet reported."""

    request: Request
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_absorbed: int = 0  # output tokens already queued for the client
    # Logprobs of prompt tokens 1, 2, ... computed so far (SamplingParams.prompt_logprobs), sent
    # whole with the first delta; a recompute after a preemption brings some again.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    def take_prompt_logprobs(self, first_idx: int, entries: list[TokenLogprobs]) -> None:
        """Keep the entries for prompt tokens first_idx, ... not already kept."""
        num_known = len(self.prompt_logprobs) - (first_idx - 1)  # entries[:num_known] are known
        if num_known >= 0:
            self.prompt_logprobs.extend(entries[num_known:])

    def absorb_tokens(self, logprobs: list[TokenLogprobs]) -> None:
        """Queue the request's tokens since the last report (one, or several when it accepted
        proposals; a stop may have cut those short, and their logprobs with them)."""
        new_token_ids = self.request.output_token_ids[self.num_absorbed :]
        self.num_absorbed += len(new_token_ids)
        self.pending_token_ids.extend(new_token_ids)
        self.pending_logprobs.extend(logprobs[: len(new_token_ids)])

    def delta(self) -> RequestDelta:
        """Everything not reported yet (and, once finished, how it ended); then nothing is."""
        request = self.request
        finished = request.is_finished
        output = RequestDelta(
            request_id=request.request_id,
            new_token_ids=self.pending_token_ids,
            new_logprobs=self.pending_logprobs,
            finished=finished,
            finish_reason=request.status.value if finished else None,
            error=request.error,
            error_code=_error_code(request.error),
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=request.num_output_tokens,
        )
        if request.sampling_params.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            output.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, []
            self.prompt_logprobs_sent = True
        self.pending_token_ids, self.pending_logprobs = [], []
        return output


def _error_code(error: str | None) -> str | None:
    if error is None:
        return None
    return error.split(":", 1)[0] if ":" in error else "engine_error"
