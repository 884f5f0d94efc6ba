"""The MTP proposer in the decode pool of a prefill/decode split: the prefill engine runs the MTP
layer over the prompt, and its latent rows (one more layer of pages) and the last prompt
position's hidden state travel with the prompt's pages; the decode engine proposes with them
from its first step, as the co-located engine does."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from densa.disagg.prefill_side import PrefillState
from densa.engine.disagg_port import max_message_bytes
from densa.engine.llm_engine import LLMEngine
from densa.offline.inproc_pair import InProcessPair
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from densa.spec.mtp import MTPProposer, PromptState
from tests.spec.test_mtp import mtp_checkpoint, mtp_model_dir  # noqa: F401  (fixtures)

PAGE_SIZE = 4
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPT = [5, 17, 230, 1234, 9, 88, 4021, 77, 301, 12, 44]  # 11 tokens: 10 MTP rows, 3 pages


def _engine(model_dir: Path) -> LLMEngine:
    args = EngineArgs(
        model=str(model_dir), max_model_len=128, num_kv_pages=64, page_size=PAGE_SIZE,
        speculative_method="mtp",
    )  # fmt: skip
    engine = LLMEngine.from_args(args)
    # The tiny target's MTP layer costs about a target step: priced as free, it always proposes.
    _proposer(engine).cost_per_token = 0.0
    return engine


def _proposer(engine: LLMEngine) -> MTPProposer:
    assert engine.speculator is not None
    proposer = engine.speculator.proposer
    assert isinstance(proposer, MTPProposer)
    return proposer


class Recorder:
    """Wraps a proposer's `propose` and keeps every call's proposals."""

    def __init__(self, proposer: MTPProposer) -> None:
        self.calls: list[list[list[int]]] = []
        inner = proposer.propose

        def propose(inputs: Any) -> list[list[int]]:
            got = inner(inputs)
            self.calls.append(got)
            return got

        proposer.propose = propose  # type: ignore[method-assign]


def _colocated(model_dir: Path) -> tuple[list[int], list[list[list[int]]], int]:
    engine = _engine(model_dir)
    recorder = Recorder(_proposer(engine))
    engine.add_request(PROMPT, PARAMS, request_id="r")
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.extend(delta.new_token_ids)
    assert engine.speculator is not None
    return tokens, recorder.calls, engine.speculator.num_accepted_tokens


def _split(pair: InProcessPair, max_turns: int = 1000) -> tuple[list[int], list[str]]:
    """Run the remote-prefill request "r" to its end: its tokens and errors."""
    agent = pair.d_agents.decode
    assert agent is not None
    pair.decode.add_request(PROMPT, PARAMS, request_id="r", remote_prefill=True)
    agent.start("r", pair.p_agents.address)
    tokens: list[int] = []
    errors: list[str] = []
    for _ in range(max_turns):
        for engine, agents in ((pair.prefill, pair.p_agents), (pair.decode, pair.d_agents)):
            agents.poll()
            if engine.has_unfinished_requests():
                for delta in agents.take_outputs(engine.step()):
                    if engine is pair.decode and delta.request_id == "r":
                        tokens.extend(delta.new_token_ids)
                        errors += [delta.error] if delta.error else []
            engine.check_invariants()
        if not (pair.prefill.has_unfinished_requests() or pair.decode.has_unfinished_requests()
                or pair.p_agents.is_busy() or pair.d_agents.is_busy()):  # fmt: skip
            break
    return tokens, errors


@pytest.fixture(scope="module")
def bigram_mtp_dir(
    mtp_model_dir: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """The tiny checkpoint made predictable, so MTP proposals are accepted: the target's layers
    write nothing into the residual stream (its next token is a function of the current one:
    lm_head(norm(embed(t)))), and the MTP layer computes the same function of t_{p+1} (the
    target's embedding through eh_proj = [I | 0], the target's final norm and head), plus a
    small contribution of its own attention and MLP, so its K/V still moves its outputs."""
    model_dir = tmp_path_factory.mktemp("tiny-dsv3-bigram-mtp")
    shutil.copytree(mtp_model_dir, model_dir, dirs_exist_ok=True)
    target = load_file(str(model_dir / "model.safetensors"))
    mtp = load_file(str(model_dir / "mtp.safetensors"))
    for tensors, scale in ((target, 0.0), (mtp, 0.1)):
        for name in tensors:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = tensors[name] * scale
    prefix, hidden = "model.layers.3.", target["model.norm.weight"].shape[0]
    mtp[prefix + "embed_tokens.weight"] = target["model.embed_tokens.weight"].clone()
    mtp[prefix + "enorm.weight"] = torch.ones(hidden)
    mtp[prefix + "eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
    mtp[prefix + "shared_head.norm.weight"] = target["model.norm.weight"].clone()
    mtp[prefix + "shared_head.head.weight"] = target["lm_head.weight"].clone()
    save_file(target, str(model_dir / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in mtp.items()}, str(model_dir / "mtp.safetensors"))
    return model_dir


@pytest.mark.parametrize("checkpoint", ["random", "bigram"])
def test_mtp_proposes_on_the_decode_worker_as_it_does_co_located(
    checkpoint: str,
    mtp_model_dir: Path,  # noqa: F811
    bigram_mtp_dir: Path,
) -> None:
    """Greedy output over the split equals the co-located output, and the decode worker's MTP
    proposals are, call for call, the co-located engine's: from the first decode step, where
    they come from the landed rows and hidden state alone (the random checkpoint: every weight
    of the layer, its K/V included, moves its proposals), and with as many accepted (the
    predictable checkpoint: most are)."""
    model_dir = mtp_model_dir if checkpoint == "random" else bigram_mtp_dir
    reference, colocated_calls, colocated_accepted = _colocated(model_dir)
    pair = InProcessPair(_engine(model_dir), _engine(model_dir))
    recorder = Recorder(_proposer(pair.decode))
    try:
        tokens, errors = _split(pair)
    finally:
        pair.close()
    assert errors == [] and tokens == reference
    assert recorder.calls == colocated_calls
    assert len(recorder.calls[0][0]) > 0  # the first call: from the landed state
    assert pair.decode.speculator is not None
    assert pair.decode.speculator.num_accepted_tokens == colocated_accepted
    if checkpoint == "bigram":
        assert colocated_accepted > len(reference) // 2
    _assert_all_pages_free(pair)


def _assert_all_pages_free(pair: InProcessPair) -> None:
    """Every page of both engines, their MTP layers' included, is free again."""
    for engine in (pair.prefill, pair.decode):
        engine.check_invariants()
        assert engine.kv_manager.pool.num_free_pages == engine.kv_manager.pool.num_pages
        assert engine.scheduler.num_held_pages == 0
        proposer = _proposer(engine)
        assert proposer.sequences == {}
        assert proposer.pool.num_free_pages == proposer.pool.num_pages


def test_a_transfer_dropped_after_its_pages_were_sent_frees_the_mtp_pages_on_both_sides(
    bigram_mtp_dir: Path,
) -> None:
    pair = InProcessPair(_engine(bigram_mtp_dir), _engine(bigram_mtp_dir))
    agent, prefill_agent = pair.d_agents.decode, pair.p_agents.prefill
    assert agent is not None and prefill_agent is not None
    pair.decode.add_request(PROMPT, PARAMS, request_id="r", remote_prefill=True)
    agent.start("r", pair.p_agents.address)
    try:
        for _ in range(100):  # until the prefill worker has sent the pages (and holds them)
            pair.d_agents.poll()
            pair.p_agents.poll()
            if pair.prefill.has_unfinished_requests():
                pair.p_agents.take_outputs(pair.prefill.step())
            if any(t.state == PrefillState.HOLDING for t in prefill_agent.transfers.values()):
                break
        # The MTP layer's rows of the prompt are held with the pages: 10 rows, 3 pages.
        (held,) = _proposer(pair.prefill).sequences.values()
        assert len(held.page_ids) == 3 and held.num_exact == 10
        pair.decode.abort_request("r")  # the client left: the pages arrive late and are dropped
        for _ in range(100):
            for engine, agents in ((pair.prefill, pair.p_agents), (pair.decode, pair.d_agents)):
                agents.poll()
                if engine.has_unfinished_requests():
                    agents.take_outputs(engine.step())
    finally:
        pair.close()
    assert agent.stats.counts["late_transfers_dropped"] == 1
    _assert_all_pages_free(pair)


def test_the_largest_message_a_peer_may_send_leaves_room_for_the_mtp_state(
    bigram_mtp_dir: Path,
) -> None:
    # 32 pages of 4 tokens; a token's latent row is 32 + 8 float32 values (160 bytes) per layer:
    # the target's 3 layers, the MTP layer's one, and one hidden state of 64 float32 values.
    assert max_message_bytes(_engine(bigram_mtp_dir)) == (16 << 20) + 32 * 4 * 160 * (3 + 1) + 256


def test_a_prefill_worker_sending_a_wrong_mtp_state_fails_only_its_transfer(
    bigram_mtp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer's MTP state is checked like its pages: here it covers one position too few."""
    pair = InProcessPair(_engine(bigram_mtp_dir), _engine(bigram_mtp_dir))
    export = MTPProposer.export_prompt

    def short(self: MTPProposer, request_id: str, prompt: Any) -> PromptState | None:
        return export(self, request_id, prompt[:-1])

    monkeypatch.setattr(MTPProposer, "export_prompt", short)
    try:
        tokens, errors = _split(pair)
    finally:
        pair.close()
    assert tokens == [] and errors == [
        "kv_transfer_failed: the prefill worker sent: unusable pages (an MTP state of 9 "
        "positions for a prompt of 11 tokens)"
    ]
    _assert_all_pages_free(pair)


def test_an_mtp_state_that_cannot_be_made_sends_the_pages_without_it(
    bigram_mtp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill worker makes the MTP state while it packs the pages (a pass of the layer
    over the prompt), outside the engine step's fault confinement: if that pass raises, the
    pages still go, without the state, and the request decodes (without MTP proposals) to the
    co-located output; neither engine stops."""
    reference, _, _ = _colocated(bigram_mtp_dir)
    pair = InProcessPair(_engine(bigram_mtp_dir), _engine(bigram_mtp_dir))

    def broken(self: MTPProposer, request_id: str, prompt: Any) -> PromptState | None:
        raise RuntimeError("the MTP layer's pass failed")

    monkeypatch.setattr(MTPProposer, "export_prompt", broken)
    try:
        tokens, errors = _split(pair)
    finally:
        pair.close()
    assert errors == [] and tokens == reference
    _assert_all_pages_free(pair)
