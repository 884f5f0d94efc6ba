"""A prefill engine and a decode engine in one process, joined by the in-process KV transport.

Everything between them is the serving path of disaggregation: the KV agents' state machines
(densa/disagg), the handshake, destination pages allocated and tagged on the decode side before
any byte moves, the wire format and the conversion at landing (e.g. BF16 -> FP8 with fresh
scales). Only the transport is in-process, and the two engine loops are turned by the caller's
thread, one after the other. Offline tools use it to measure what the split does to quality
(`densa eval split`); tests/disagg has its own harness with a fake clock and fault injection.

After a handoff the decode engine's request has ended and its landed pages are blocks of its
prefix cache, in the request's scope: a later request of that scope whose tokens start with the
prompt maps them instead of computing them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from densa.auth.secret import ClusterSecret
from densa.disagg.transport import InProcessHub, InProcessTransport
from densa.engine.disagg_port import KVAgents
from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams

MAX_TURNS = 10_000  # one handoff takes a few turns per prompt chunk; this is "it hangs"


@dataclass(frozen=True)
class Handoff:
    """What one prompt's handoff did (counted on the decode side)."""

    first_block: int  # prompt blocks before this one were already cached on decode (not moved)
    num_pages: int  # pages landed
    num_bytes: int  # bytes that crossed the transport (page frames)
    first_token_id: int  # sampled by the prefill engine


class InProcessPair:
    """Hand prompts' KV pages from `prefill` to `decode` (both idle between handoffs)."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine, timeout_s: float = 300.0) -> None:
        hub = InProcessHub()
        self.prefill = prefill
        self.decode = decode
        secret = ClusterSecret.generate()  # this pair's own: no other process holds it
        self.p_agents = KVAgents(prefill, "prefill", InProcessTransport(hub), timeout_s,
                                 secret=secret)  # fmt: skip
        self.d_agents = KVAgents(decode, "decode", InProcessTransport(hub), timeout_s,
                                 secret=secret)  # fmt: skip
        self._ids = itertools.count()

    def handoff(self, prompt_ids: list[int], cache_scope: str) -> Handoff:
        """Prefill `prompt_ids` on the prefill engine and land its pages on the decode engine
        (a request of max_tokens=1 that ends on landing). Raises RuntimeError if it fails."""
        agent = self.d_agents.decode
        assert agent is not None
        request_id = f"split-{next(self._ids)}"
        params = SamplingParams(max_tokens=1, temperature=0.0)
        self.decode.add_request(
            prompt_ids, params, request_id=request_id, cache_scope=cache_scope, remote_prefill=True
        )
        before = dict(agent.stats.counts)
        transfer = agent.start(request_id, self.p_agents.address)
        first_token, error = self._run(request_id)
        if error is not None or first_token is None:
            raise RuntimeError(f"the KV handoff of {request_id} failed: {error}")
        assert transfer.reservation is not None  # it landed, so pages were reserved
        counts = agent.stats.counts
        return Handoff(
            first_block=transfer.reservation.first_block,
            num_pages=int(counts["pages"] - before.get("pages", 0)),
            num_bytes=int(counts["bytes"] - before.get("bytes", 0)),
            first_token_id=first_token,
        )

    def _run(self, request_id: str) -> tuple[int | None, str | None]:
        """Turn both engine loops until both are idle; the request's first token and error."""
        first_token, error = None, None
        for _ in range(MAX_TURNS):
            for engine, agents in ((self.prefill, self.p_agents), (self.decode, self.d_agents)):
                agents.poll()
                if not engine.has_unfinished_requests():
                    continue
                for delta in agents.take_outputs(engine.step()):
                    if delta.request_id == request_id:
                        first_token = delta.new_token_ids[0] if delta.new_token_ids else first_token
                        error = delta.error or error
            if self._is_idle():
                return first_token, error
        raise RuntimeError(f"the KV handoff of {request_id} did not finish in {MAX_TURNS} turns")

    def _is_idle(self) -> bool:
        return not (
            self.prefill.has_unfinished_requests()
            or self.decode.has_unfinished_requests()
            or self.p_agents.is_busy()
            or self.d_agents.is_busy()
        )

    def close(self) -> None:
        self.p_agents.close()
        self.d_agents.close()
