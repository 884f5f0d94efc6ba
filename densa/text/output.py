"""A request's token deltas -> its text deltas: incremental detokenization and stop strings.

The engine reports tokens (ipc.RequestDelta); whoever serves the request turns them into text
here -- the HTTP front per request, or the offline LLM. A stop string is found here too, so the
engine never handles text: when `TextStream.stopped` turns true, the caller aborts the request in
the engine (it may have sampled a token or two more by then; those are dropped, and the usage
counts only the tokens up to the one that completed the stop string).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from densa.ipc.messages import RequestDelta, TokenLogprobs
from densa.sampling_params import SamplingParams
from densa.text.detokenizer import Detokenizer
from densa.text.tokenizer import Tokenizer


@dataclass
class RequestOutput:
    """What one request produced since its last output, as text."""

    request_id: str
    new_token_ids: list[int]  # tokens since the last output of this request
    new_text: str  # text released since the last output (stop-string prefixes held back)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # set when finish_reason == "error"
    error_code: str | None = None  # machine-readable, e.g. "kv_integrity_violation"
    stop_string: str | None = None  # the stop string that ended the request, if one did
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0  # tokens handed out so far (up to a stop string, not past it)
    # SamplingParams.prompt_logprobs: prompt tokens 1 .. P - 1, on the first output only.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Filled on the final output only (offline API convenience): the whole generation.
    text: str | None = None
    token_ids: list[int] | None = None


class TextStream:
    """One request's text state, fed its RequestDeltas in order."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.request_id = request_id
        self._detokenizer = Detokenizer(
            tokenizer,
            prompt_token_ids,
            params.stop,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
            params.kept_special_token_ids,
        )
        self._token_ids: list[int] = []
        # The tokens that end this request (the engine's stop rule): shown only if asked.
        eos = () if params.ignore_eos else tokenizer.eos_token_ids
        self._ending_ids = frozenset((*params.stop_token_ids, *eos))
        self._shows_ending_token = params.include_stop_str_in_output
        # Scoring clients (lm-evaluation-harness: echo, logprobs, max_tokens 1) read the last
        # logprobs entry as the one generated token, whatever it is: with echo it stays listed.
        self._lists_ending_logprob = params.prompt_logprobs is not None
        self.stopped = False  # a stop string ended it: abort the engine request
        self.finished = False

    def process(self, delta: RequestDelta) -> RequestOutput | None:
        """The text output for one delta; None once the request has finished (late deltas of
        a request stopped by a stop string are dropped)."""
        if self.finished:
            return None
        ending = self._ending_token(delta)
        token_ids = delta.new_token_ids[:-1] if ending is not None else delta.new_token_ids
        accepted = self._take_tokens(token_ids)
        logprobs = delta.new_logprobs[: len(accepted)]
        if ending is not None and not self.stopped:
            accepted.append(ending)  # counted in the usage; no text (nor, but with echo, logprobs)
            self._token_ids.append(ending)
            if self._lists_ending_logprob:
                logprobs = delta.new_logprobs[: len(accepted)]
        self.finished = self.stopped or delta.finished
        reason = "stop" if self.stopped else delta.finish_reason
        output = RequestOutput(
            request_id=self.request_id,
            new_token_ids=accepted,
            new_text=self._detokenizer.take_delta(self.finished),
            new_logprobs=logprobs,
            finished=self.finished,
            finish_reason=reason if self.finished else None,
            error=None if self.stopped else delta.error,
            error_code=None if self.stopped else delta.error_code,
            stop_string=self._detokenizer.stop_string,
            num_prompt_tokens=delta.num_prompt_tokens,
            num_cached_tokens=delta.num_cached_tokens,
            num_output_tokens=len(self._token_ids),
            prompt_logprobs=delta.prompt_logprobs,
        )
        if self.finished:
            output.text = self._detokenizer.text
            output.token_ids = list(self._token_ids)
        return output

    def _ending_token(self, delta: RequestDelta) -> int | None:
        """The stop token (EOS or a stop_token_ids entry) that ended the request in this delta:
        the engine ends a request "stop" on such a token, its last. As OpenAI does, it is
        not part of the answer -- neither its text nor its logprobs, so `logprobs.content`
        joins to the content -- unless the client asked for stop text in the output."""
        if self._shows_ending_token or not (delta.finished and delta.finish_reason == "stop"):
            return None
        last = delta.new_token_ids[-1] if delta.new_token_ids else None
        return last if last in self._ending_ids else None

    def _take_tokens(self, token_ids: list[int]) -> list[int]:
        """Detokenize tokens one at a time; stop after the one that completes a stop string."""
        accepted = []
        for token_id in token_ids:
            accepted.append(token_id)
            self._token_ids.append(token_id)
            self._detokenizer.add_token(token_id)
            if self._detokenizer.check_stop():
                self.stopped = True
                break
        return accepted


def error_output(request_id: str, message: str, code: str) -> RequestOutput:
    """A request that ends before it produced anything (refused, or its engine went away)."""
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="error",
        error=message,
        error_code=code,
    )
