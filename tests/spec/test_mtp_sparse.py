"""GLM-5's MTP layer (num_nextn_predict_layers) through the MTP proposer: a sparse-attention
decoder layer running its own indexer over its own index keys (in the proposer's pages). Its
proposals are those of transformers' GLM-5 decoder layer over the same weights and hidden
states on histories past the 16 tokens the indexer keeps, and greedy output with MTP on is
the output without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from densa.engine.llm import LLM
from densa.sampling_params import SamplingParams
from densa.spec.mtp import MTPProposer
from densa.spec.proposer import SpecInput, TargetRows
from tests.tiny_families import save_tiny

from .test_mtp import PAGE_SIZE, K, ReferenceMTP, _proposer, _target_hidden, add_mtp_layer

HISTORY = [(37 * i + 11) % 4000 + 5 for i in range(30)]


@pytest.fixture(scope="module")
def glm_mtp(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> tuple[Path, Any]:
    model_dir = save_tiny("glm_moe_dsa", tmp_path_factory.mktemp("tiny-glm-mtp"), smollm2_dir)
    return model_dir, add_mtp_layer(model_dir, family="glm_moe_dsa")


def test_glm_mtp_proposals_match_transformers_layer(glm_mtp: tuple[Path, Any]) -> None:
    model_dir, host = glm_mtp
    hidden = _target_hidden(model_dir, HISTORY)
    reference = ReferenceMTP(model_dir, host)
    proposer = _proposer(model_dir)
    assert proposer.cache.index is not None  # the layer's own index keys, in its pages
    n1 = 24  # past the 16 tokens its indexer keeps
    proposer.observe_hidden("r", TargetRows(0, HISTORY[: n1 - 1], hidden[: n1 - 1]))
    assert proposer.propose([SpecInput("r", HISTORY[:n1], K)]) == [
        reference.propose(HISTORY[:n1], hidden, K)
    ]
    n2 = n1 + 3
    proposer.observe_hidden(
        "r", TargetRows(n1 - 1, HISTORY[n1 - 1 : n2 - 1], hidden[n1 - 1 : n2 - 1])
    )
    assert proposer.propose([SpecInput("r", HISTORY[:n2], K)]) == [
        reference.propose(HISTORY[:n2], hidden, K)
    ]
    proposer.release("r")
    assert proposer.pool.num_free_pages == 32


def test_glm_with_mtp_on_greedy_output_is_unchanged(glm_mtp: tuple[Path, Any]) -> None:
    model_dir, _ = glm_mtp
    prompts = [HISTORY[:20], HISTORY[5:28]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = dict(num_kv_pages=64, page_size=PAGE_SIZE, max_model_len=128)
    plain = [r.token_ids for r in LLM(str(model_dir), **engine).generate(prompts, greedy)]
    llm = LLM(str(model_dir), speculative_method="mtp", **engine)
    speculator = llm.engine.speculator
    assert speculator is not None and isinstance(speculator.proposer, MTPProposer)
    speculator.proposer.cost_per_token = 0.0  # priced as free: it proposes every step
    assert [r.token_ids for r in llm.generate(prompts, greedy)] == plain
    assert speculator.num_proposed_tokens > 0 and speculator.num_accepted_tokens >= 0
    assert speculator.proposer.pool.num_free_pages == engine["num_kv_pages"]
    assert torch.is_tensor(speculator.proposer.cache.latent)
