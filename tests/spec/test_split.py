"""Speculation in the decode pool of a prefill/decode split: the prompt's K/V lands from the
prefill engine, and the decode engine's proposals are verified on top of it like any other
decode rows. The greedy output equals the co-located one without speculation."""

from __future__ import annotations

from pathlib import Path

from densa.config import SpeculativeConfig
from densa.engine.llm_engine import LLMEngine
from densa.offline.inproc_pair import InProcessPair
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from densa.spec.speculator import Speculator
from tests.spec.test_exact_greedy import ScriptedProposer

PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPT = [300 + 17 * i for i in range(21)]


def _engine(model_dir: Path) -> LLMEngine:
    args = EngineArgs(model=str(model_dir), max_model_len=256, num_kv_pages=200, page_size=4)
    return LLMEngine.from_args(args)


def _colocated(engine: LLMEngine) -> list[int]:
    request_id = engine.add_request(PROMPT, PARAMS)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id == request_id:
                tokens.extend(delta.new_token_ids)
    return tokens


def test_the_decode_pool_speculates_on_landed_pages(tiny_model_dir: Path) -> None:
    reference = _colocated(_engine(tiny_model_dir))
    prefill, decode = _engine(tiny_model_dir), _engine(tiny_model_dir)
    proposer = ScriptedProposer()
    proposer.full["split"] = PROMPT + reference
    decode.speculator = Speculator(proposer, SpeculativeConfig(num_tokens=4))
    pair = InProcessPair(prefill, decode)
    try:
        decode.add_request(PROMPT, PARAMS, request_id="split", remote_prefill=True)
        agent = pair.d_agents.decode
        assert agent is not None
        agent.start("split", pair.p_agents.address)
        tokens: list[int] = []
        for _ in range(1000):
            for engine, agents in ((prefill, pair.p_agents), (decode, pair.d_agents)):
                agents.poll()
                if engine.has_unfinished_requests():
                    for delta in agents.take_outputs(engine.step()):
                        if engine is decode and delta.request_id == "split":
                            assert delta.error is None, delta.error
                            tokens.extend(delta.new_token_ids)
                decode.check_invariants()
            if not (prefill.has_unfinished_requests() or decode.has_unfinished_requests()):
                break
    finally:
        pair.close()
    assert tokens == reference
    assert decode.speculator.num_accepted_tokens > 0
    assert "split" in proposer.released
