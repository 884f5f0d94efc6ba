"""The one stop rule: when a request ends on the token it just got, and which tokens would end it.

The scheduler asks `status` after every sampled token; the sampler asks `ending_tokens` to keep
those tokens out while a request is below its min_tokens. Both read the EOS ids from here, and
here they come from one place: the engine's SchedulerConfig (the tokenizer's, resolved once).
"""

from __future__ import annotations

from dataclasses import dataclass

from densa.config import SchedulerConfig
from densa.request import RequestStatus
from densa.sampling_params import SamplingParams


@dataclass(frozen=True)
class StopRule:
    eos_token_ids: tuple[int, ...]
    max_model_len: int

    @classmethod
    def of(cls, config: SchedulerConfig) -> StopRule:
        return cls(config.eos_token_ids, config.max_model_len)

    def ending_tokens(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that end a request with these parameters (once min_tokens is reached):
        what the sampler keeps out below min_tokens."""
        if params.ignore_eos:
            return params.stop_token_set
        return params.stop_token_set | frozenset(self.eos_token_ids)

    def is_ending(self, params: SamplingParams, token_id: int) -> bool:
        """Does `token_id` end the request? Asked after every sampled token, so it builds
        nothing: the request's stop set is built once (SamplingParams.stop_token_set)."""
        if token_id in params.stop_token_set:
            return True
        return not params.ignore_eos and token_id in self.eos_token_ids

    def status(
        self, params: SamplingParams, num_output: int, num_tokens: int, token_id: int
    ) -> RequestStatus | None:
        """Why a request with `num_output` tokens out (`num_tokens` in all, the new `token_id`
        included) ends now, or None if it goes on."""
        if num_output >= params.min_tokens and self.is_ending(params, token_id):
            return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
