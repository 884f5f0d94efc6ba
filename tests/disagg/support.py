"""Two engines (a prefill and a decode worker) in one process, joined by a KV transport, driven
step by step: the unit-level harness for the handoff (exact pages, tags and states)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from densa.auth.secret import ClusterSecret
from densa.disagg.transport import InProcessHub, InProcessTransport, KVTransport
from densa.engine.disagg_port import KVAgents
from densa.engine.llm_engine import LLMEngine
from densa.ipc.messages import RequestDelta
from densa.sampling_params import SamplingParams
from tests.serve.support import make_engine


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Pair:
    prefill: LLMEngine
    decode: LLMEngine
    p_agents: KVAgents
    d_agents: KVAgents
    clock: FakeClock
    outputs: dict[str, list[RequestDelta]] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.p_agents.address

    def submit(self, prompt: list[int], params: SamplingParams, request_id: str) -> None:
        self.decode.add_request(prompt, params, request_id=request_id, remote_prefill=True)
        assert self.d_agents.decode is not None
        self.d_agents.decode.start(request_id, self.address)

    def turn(self, run_prefill: bool = True) -> None:
        """One turn of both engine loops: agents first, then a step where there is work.
        run_prefill=False: the prefill engine computes nothing (a slow or stuck worker)."""
        for engine, agents in ((self.prefill, self.p_agents), (self.decode, self.d_agents)):
            agents.poll()
            if engine is self.prefill and not run_prefill:
                continue
            if engine.has_unfinished_requests():
                for delta in agents.take_outputs(engine.step()):
                    self.outputs.setdefault(delta.request_id, []).append(delta)
            engine.check_invariants()

    def run(self, max_turns: int = 500, advance_s: float = 0.0) -> None:
        for _ in range(max_turns):
            self.turn()
            self.clock.now += advance_s
            if self.is_idle():
                return
        raise AssertionError("the pair did not go idle")

    def assert_all_free(self) -> None:
        """Both sides: no request, no held page, every page free, no transfer in flight."""
        for engine in (self.prefill, self.decode):
            assert not engine.scheduler.requests and not engine.scheduler.held
            assert engine.kv_manager.num_free_pages == engine.kv_manager.num_pages
            assert engine.integrity_stats.total == 0
        assert not self.p_agents.is_busy() and not self.d_agents.is_busy()

    @property
    def d_agent(self) -> Any:
        return self.d_agents.decode

    @property
    def p_agent(self) -> Any:
        return self.p_agents.prefill

    def run_until_answered(self, request_id: str, max_turns: int = 200) -> None:
        """Turn until the request's final output is out (the agents may still hold pages)."""
        for _ in range(max_turns):
            self.turn()
            outputs = self.outputs.get(request_id)
            if outputs and outputs[-1].finished:
                return
        raise AssertionError(f"{request_id} got no final answer")

    def is_idle(self) -> bool:
        return not (
            self.prefill.has_unfinished_requests()
            or self.decode.has_unfinished_requests()
            or self.p_agents.is_busy()
            or self.d_agents.is_busy()
        )

    def tokens(self, request_id: str) -> list[int]:
        return [t for d in self.outputs.get(request_id, []) for t in d.new_token_ids]

    def final(self, request_id: str) -> RequestDelta:
        last = self.outputs[request_id][-1]
        assert last.finished
        return last


def make_pair(
    model_dir: Path,
    prefill_args: dict[str, Any] | None = None,
    decode_args: dict[str, Any] | None = None,
    timeout_s: float = 5.0,
    wrap: Any = None,
) -> Pair:
    """wrap(transport, side) -> transport lets a test put a FaultyTransport on either side."""
    hub = InProcessHub()
    clock = FakeClock()
    prefill = make_engine(model_dir, **(prefill_args or {}))
    decode = make_engine(model_dir, **(decode_args or {}))
    p_transport: KVTransport = InProcessTransport(hub)
    d_transport: KVTransport = InProcessTransport(hub)
    if wrap is not None:
        p_transport, d_transport = wrap(p_transport, "prefill"), wrap(d_transport, "decode")
    secret = ClusterSecret.generate()  # the pair's own (no KV link runs without a secret)
    p_agents = KVAgents(prefill, "prefill", p_transport, timeout_s, secret=secret)
    d_agents = KVAgents(decode, "decode", d_transport, timeout_s, secret=secret)
    for agents in (p_agents, d_agents):
        agent = agents.prefill or agents.decode
        assert agent is not None
        agent.clock = clock
    return Pair(prefill, decode, p_agents, d_agents, clock)


def colocated_tokens(
    model_dir: Path, prompts: list[list[int]], params: SamplingParams, **engine_args: Any
) -> list[list[int]]:
    engine = make_engine(model_dir, **engine_args)
    ids = [engine.add_request(p, params) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out[delta.request_id].extend(delta.new_token_ids)
    return [out[i] for i in ids]
