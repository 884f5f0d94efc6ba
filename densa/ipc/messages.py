"""The typed contract between the HTTP front and the engine core (and, later, between workers).

Plain data only (msgspec Structs and the frozen SamplingParams dataclass), never engine objects:
the same messages cross a thread, a process or a TCP connection unchanged (`ipc/codec.py`).

    front -> engine:  AddRequest, AbortRequests, SetStepDelay (tests), Shutdown
    engine -> front:  Hello (once, the ServedModel), StepOutputs (per step), Heartbeat

A request crosses once (AddRequest); from then on only what changed travels: per step, each
request's new tokens (RequestDelta), its finish, and the engine's counters (EngineStats).
Detokenization and stop strings are the front's job (`text/`), so the engine never sees text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from densa.sampling_params import SamplingParams


# ---- per-request data ---------------------------------------------------------------------------
class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the N most likely tokens under the model, best first


class RequestDelta(msgspec.Struct, array_like=True):
    """What changed for one request in one engine step."""

    request_id: str
    new_token_ids: list[int]  # tokens sampled since the last delta of this request
    new_logprobs: list[TokenLogprobs] = []
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # set when finish_reason == "error"
    error_code: str | None = None  # machine-readable, e.g. "kv_integrity_violation"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_output_tokens: int = 0  # tokens the engine has sampled for it so far
    # SamplingParams.prompt_logprobs: prompt tokens 1 .. P - 1 (token 0 has none), all at once in
    # the request's first delta.
    prompt_logprobs: list[TokenLogprobs] = []


class EngineStats(msgspec.Struct, frozen=True, array_like=True):
    """What the engine looks like right now, plus totals since it started (for /metrics)."""

    num_running: int = 0  # requests holding pages and scheduled every step
    num_waiting: int = 0  # queued or preempted requests (no pages)
    num_session_requests: int = 0  # running + waiting requests that carry a session id
    num_kv_pages: int = 0
    num_free_kv_pages: int = 0  # includes free pages still holding a reusable cached prefix
    num_cached_kv_pages: int = 0  # pages indexed by the prefix cache (owned or free)
    page_size: int = 0
    # Tokens whose K/V the running requests hold; a prefix shared by n requests counts n times.
    num_resident_tokens: int = 0
    # Lifetime totals.
    num_steps: int = 0
    num_preemptions: int = 0
    num_generated_tokens: int = 0  # sampled by the engine, including any nobody received
    num_prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    num_prefix_hit_tokens: int = 0  # ... of which were found there
    integrity_violations: dict[str, int] = {}  # by ViolationKind value
    # KV handoff counters and gauges of a prefill or decode worker (densa/disagg/stats.py).
    disagg: dict[str, float] = {}
    # KV tiers (--kv-tier): counters per tier name (densa/cache/tiers/tier.py TierCounters).
    kv_tiers: dict[str, dict[str, float]] = {}
    # The shared tier's store id ('' without one): routers credit blocks another worker of the
    # same store computed (densa/router/prefix.py SharedTierIndex).
    shared_kv_tier: str = ""
    # Speculative decoding (docs/speculative.md), lifetime totals: tokens proposed to the
    # target, how many it accepted, and steps on which the batch was too large to speculate.
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_paused_steps: int = 0

    @property
    def num_used_kv_pages(self) -> int:
        return self.num_kv_pages - self.num_free_kv_pages

    @property
    def num_unfinished(self) -> int:
        return self.num_running + self.num_waiting

    @property
    def prefix_hit_rate(self) -> float:
        """Share of looked-up prompt tokens served from the cache (0 before any lookup)."""
        if not self.num_prefix_queried_tokens:
            return 0.0
        return self.num_prefix_hit_tokens / self.num_prefix_queried_tokens


@dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer as data: the text of its files (None: the file is absent). The engine reads
    them once (text/tokenizer.py, read_tokenizer_files) and sends them to every front."""

    tokenizer_json: str
    config_json: str | None = None
    chat_template: str | None = None


class ServedModel(msgspec.Struct, frozen=True):
    """Everything a front needs to know about the engine behind it, sent once on connecting.

    The tokenizer travels as its files' text, so a front on another host tokenizes exactly as
    the engine's host would, with no shared filesystem.
    """

    name: str  # the id clients send as "model"
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer: TokenizerFiles
    max_num_seqs: int
    max_waiting_requests: int
    page_size: int
    num_kv_pages: int
    kv_format: str  # e.g. "fp8_e4m3, dynamic scales"
    weight_format: str  # e.g. "dense", "int4 g128 symmetric"
    architecture: dict[str, Any] = {}  # layer and head shapes, for peers to check they match
    engine_pid: int = 0
    role: str = "both"  # both | prefill | decode (docs/disaggregation.md)
    kv_address: str = ""  # a prefill worker's KV transfer address (decode workers connect)


# ---- front -> engine ----------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_scope: str = ""  # the prefix-cache scope digest (cache/scope.py)
    session_id: str | None = None
    # A decode worker: the KV address of the prefill worker that computes the prompt ("": here).
    prefill_address: str = ""


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class SetStepDelay(msgspec.Struct, tag=True):
    """Sleep this long before every step: lets tests keep requests in flight for seconds.
    Honoured only by an engine started with debug controls enabled."""

    seconds: float
    # Sleep holding the GIL, as a long native call that keeps it would: the engine's heartbeat
    # thread cannot run meanwhile (tests of liveness at any step length).
    hold_gil: bool = False


class Shutdown(msgspec.Struct, tag=True):
    pass


ToEngine = AddRequest | AbortRequests | SetStepDelay | Shutdown


# ---- engine -> front ----------------------------------------------------------------------------
class Hello(msgspec.Struct, tag=True):
    served: ServedModel


class StepOutputs(msgspec.Struct, tag=True):
    deltas: list[RequestDelta]
    stats: EngineStats


class Heartbeat(msgspec.Struct, tag=True):
    """Sent every heartbeat interval by a thread of its own, so a long step still beats while it
    lets the thread run (not while it holds the GIL); a step running for longer than the front
    allows means the engine is stuck."""

    num_steps: int
    step_running_s: float  # how long the current step has been running (0 between steps)
    stats: EngineStats


class EngineFailed(msgspec.Struct, tag=True):
    """The engine cannot go on (e.g. the model failed to load); it exits after sending this."""

    message: str


FromEngine = Hello | StepOutputs | Heartbeat | EngineFailed
