"""The DeepSeek-V3 MTP proposer on a tiny random checkpoint with an MTP layer: its proposals are
those of a slow reference built on transformers' own DeepSeek-V3 decoder layer (full causal
attention, no pages) over the same weights and the same target hidden states."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.attention_backends import select_backend
from densa.spec.mtp import FOLD_ROWS, MTPProposer, load_mtp_proposer
from densa.spec.proposer import SpecInput, TargetRows
from tests.tiny_families import CONFIGS, config_fields, save_tiny

CPU = torch.device("cpu")
PAGE_SIZE = 4
K = 3


def add_mtp_layer(model_dir: Path, seed: int = 11, family: str = "deepseek_v3") -> Any:
    """Append an MTP layer (one more decoder layer from transformers, plus enorm / hnorm /
    eh_proj / shared_head / embed_tokens) to a saved tiny DeepSeek-V3 (or GLM-5: its MTP layer
    runs its own indexer) and say so in its config; returns the transformers model whose last
    layer it is (the reference's block)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = CONFIGS[family]()
    num_layers = config.num_hidden_layers
    settings = config.to_dict() | {"num_hidden_layers": num_layers + 1}
    if settings.get("indexer_types") is not None:  # the MTP layer runs its own indexer
        settings["indexer_types"] = [*settings["indexer_types"], "full"]
    config = type(config)(**config_fields(settings))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    host = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in host.named_parameters():
            if not name.endswith("e_score_correction_bias"):
                param.normal_(0, 0.08)
        for name, buffer in host.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.05)
    host.save_pretrained(str(model_dir / "host"), safe_serialization=True)
    prefix = f"model.layers.{num_layers}."
    saved = load_file(str(model_dir / "host" / "model.safetensors"))
    tensors = {name: value for name, value in saved.items() if name.startswith(prefix)}
    hidden, vocab = config.hidden_size, config.vocab_size
    own = {
        "embed_tokens.weight": torch.randn(vocab, hidden) * 0.08,
        "enorm.weight": 1 + 0.1 * torch.randn(hidden),
        "hnorm.weight": 1 + 0.1 * torch.randn(hidden),
        "eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.08,
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden),
        "shared_head.head.weight": torch.randn(vocab, hidden) * 0.08,
    }
    tensors.update({prefix + name: value for name, value in own.items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(model_dir / "mtp.safetensors"))
    shutil.rmtree(model_dir / "host")
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_nextn_predict_layers"] = 1
    cfg_path.write_text(json.dumps(cfg))
    return host


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> tuple[Path, Any]:
    model_dir = save_tiny("deepseek_v3", tmp_path_factory.mktemp("tiny-dsv3-mtp"), smollm2_dir)
    return model_dir, add_mtp_layer(model_dir)


@pytest.fixture(scope="module")
def mtp_model_dir(mtp_checkpoint: tuple[Path, Any]) -> Path:
    return mtp_checkpoint[0]


class ReferenceMTP:
    """The MTP layer as the paper writes it, with transformers' decoder layer as its block."""

    def __init__(self, model_dir: Path, host: Any) -> None:
        from safetensors.torch import load_file

        config = host.config
        weights = load_file(str(model_dir / "mtp.safetensors"))
        num_layers = config.num_hidden_layers - 1  # the MTP layer is the host's last
        prefix = f"model.layers.{num_layers}."
        self.w = {k.removeprefix(prefix): v for k, v in weights.items()}
        self.block = host.model.layers[num_layers]
        self.rotary = host.model.rotary_emb
        self.eps = config.rms_norm_eps

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    @torch.no_grad()
    def outputs(self, next_ids: list[int], prev_hidden: torch.Tensor) -> torch.Tensor:
        """o_p for p = 0..T-1 from t_{p+1} (next_ids) and h_p (prev_hidden [T, H])."""
        embedded = self._norm(self.w["embed_tokens.weight"][next_ids], "enorm.weight")
        x = torch.cat([embedded, self._norm(prev_hidden, "hnorm.weight")], -1)
        x = (x @ self.w["eh_proj.weight"].T)[None]  # [1, T, H]
        num = x.shape[1]
        positions = torch.arange(num)[None]
        mask = torch.full((num, num), float("-inf")).triu(1)[None, None]
        cos_sin = self.rotary(x, positions)
        out = self.block(x, mask, positions, position_embeddings=cos_sin)
        if isinstance(out, tuple):  # GLM-5's layers also return their top-k
            out = out[0]
        return out[0]

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        return self._norm(o, "shared_head.norm.weight") @ self.w["shared_head.head.weight"].T

    def propose(self, token_ids: list[int], hidden: torch.Tensor, k: int) -> list[int]:
        """k proposals: the newest position, then the layer fed its own output k - 1 times."""
        next_ids, prev = list(token_ids[1:]), hidden[: len(token_ids) - 1]
        proposals: list[int] = []
        for _ in range(k):
            o = self.outputs(next_ids, prev)
            proposals.append(int(self.logits(o[-1]).argmax()))
            next_ids.append(proposals[-1])
            prev = torch.cat([prev, o[-1:]])
        return proposals


def _target_hidden(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """The target's final (normed) hidden states, from transformers: [T, H]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        return model.model(torch.tensor([token_ids])).last_hidden_state[0]


def _rows(token_ids: list[int], width: int, start_pos: int = 0) -> TargetRows:
    """The target kept these tokens from start_pos on; any hidden states will do."""
    return TargetRows(start_pos, token_ids, torch.randn(len(token_ids), width))


def _proposer(model_dir: Path, num_pages: int = 32) -> MTPProposer:
    arch = ArchConfig.from_dir(model_dir)
    backend = select_backend("auto", CPU)
    return load_mtp_proposer(model_dir, arch, "float32", num_pages, PAGE_SIZE, backend, CPU, 256)


def test_mtp_proposals_match_the_reference_across_rounds(
    mtp_checkpoint: tuple[Path, Any],
) -> None:
    mtp_model_dir, host = mtp_checkpoint
    prompt = [5, 17, 230, 1234, 9, 88, 4021, 77, 301]
    accepted = [3000, 12, 44, 9000, 5]  # the target's next tokens (any: they are inputs here)
    history = prompt + accepted
    hidden = _target_hidden(mtp_model_dir, history)
    reference = ReferenceMTP(mtp_model_dir, host)
    proposer = _proposer(mtp_model_dir)
    # Round 1: the prompt is in the target's KV (its hidden states observed), t_P sampled.
    n1 = len(prompt) + 1
    proposer.observe_hidden("r", TargetRows(0, history[: n1 - 1], hidden[: n1 - 1]))
    got = proposer.propose([SpecInput("r", history[:n1], K)])
    assert got == [reference.propose(history[:n1], hidden, K)]
    # Round 2: two more positions accepted (whatever was proposed): only they are new rows.
    n2 = n1 + 2
    proposer.observe_hidden(
        "r", TargetRows(n1 - 1, history[n1 - 1 : n2 - 1], hidden[n1 - 1 : n2 - 1])
    )
    got = proposer.propose([SpecInput("r", history[:n2], K)])
    assert got == [reference.propose(history[:n2], hidden, K)]
    assert proposer.sequences["r"].num_exact == n2 - 1
    proposer.release("r")
    assert proposer.pool.num_free_pages == 32


def test_a_request_that_waits_holds_few_hidden_states_and_proposes_exactly_later(
    mtp_checkpoint: tuple[Path, Any],
) -> None:
    """A request that does not propose for many steps (its batch too large to speculate) has
    its hidden states folded into exact rows every FOLD_ROWS positions, not kept until it
    proposes; its proposals afterwards are the reference's over the whole history."""
    mtp_model_dir, host = mtp_checkpoint
    history = [int(t) for t in torch.randint(5, 4000, (12 + 2 * FOLD_ROWS + 9,))]
    hidden = _target_hidden(mtp_model_dir, history)
    proposer = _proposer(mtp_model_dir, num_pages=40)  # 160 positions
    proposer.observe_hidden("r", TargetRows(0, history[:12], hidden[:12]))
    held = []
    for pos in range(12, len(history) - 1):  # one decode step each, nothing proposed
        proposer.observe_hidden("r", TargetRows(pos, history[pos : pos + 1], hidden[pos : pos + 1]))
        seq = proposer.sequences["r"]
        held.append(sum(chunk.shape[0] for chunk in seq.hidden))
    assert max(held) == FOLD_ROWS + 2  # the newest exact h, FOLD_ROWS + 1 waiting
    # folded when positions 0..65 and 0..130 were seen: the rows of all but the newest exact
    assert proposer.sequences["r"].num_exact == 2 * FOLD_ROWS + 2
    got = proposer.propose([SpecInput("r", history, K)])
    assert got == [ReferenceMTP(mtp_model_dir, host).propose(history, hidden, K)]


def test_a_request_not_seen_from_its_first_position_gets_no_state(mtp_model_dir: Path) -> None:
    """Its rows before the first position seen (a prefix-cache hit, a state dropped or never
    landed) cannot be exact: it is ignored, and a gap in what it is shown drops its state."""
    proposer = _proposer(mtp_model_dir)
    width = ArchConfig.from_dir(mtp_model_dir).hidden_size
    prompt = [5, 17, 230, 1234, 9, 88, 4021, 77, 301, 3000]
    proposer.observe_hidden("hit", _rows(prompt[4:], width, start_pos=4))
    assert "hit" not in proposer.sequences
    assert proposer.propose([SpecInput("hit", prompt, K)]) == [[]]
    proposer.observe_hidden("gap", _rows(prompt[:5], width))
    assert len(proposer.propose([SpecInput("gap", prompt[:6], K)])[0]) == K
    proposer.observe_hidden("gap", _rows(prompt[6:], width, start_pos=6))  # position 5 missing
    assert "gap" not in proposer.sequences and proposer.pool.num_free_pages == 32
    proposer.observe_hidden("gap", _rows(prompt[9:], width, start_pos=9))
    assert "gap" not in proposer.sequences


def test_without_the_targets_hidden_states_it_proposes_nothing(mtp_model_dir: Path) -> None:
    proposer = _proposer(mtp_model_dir)
    assert proposer.propose([SpecInput("r", [1, 2, 3, 4], K)]) == [[]]


def test_the_mtp_pool_queues_no_tag_updates_nobody_reads(mtp_model_dir: Path) -> None:
    """Only the target pool's tag changes are mirrored into the worker's table; the MTP
    layer's own pool must not queue its own for a reader that never comes."""
    proposer = _proposer(mtp_model_dir)
    width = ArchConfig.from_dir(mtp_model_dir).hidden_size
    prompt = [5, 17, 230, 1234, 9, 88, 4021, 77, 301, 3000]
    for request_id in ("a", "b"):
        proposer.observe_hidden(request_id, _rows(prompt[:-1], width))
        assert len(proposer.propose([SpecInput(request_id, prompt, K)])[0]) == K
        proposer.release(request_id)
    assert proposer.pool.num_free_pages == 32
    assert proposer.pool.drain_tag_updates() == []


def test_a_stale_page_found_at_export_is_reported_and_sends_no_state(mtp_model_dir: Path) -> None:
    """The prefill side exports a prompt's MTP rows only from pages it still owns; a page freed
    behind the request is counted as a violation and the request's pages are released."""
    proposer = _proposer(mtp_model_dir)
    width = ArchConfig.from_dir(mtp_model_dir).hidden_size
    prompt = [5, 17, 230, 1234, 9, 88, 4021, 77, 301, 3000]
    proposer.observe_hidden("r", _rows(prompt, width))
    assert len(proposer.propose([SpecInput("r", prompt, K)])[0]) == K
    seq = proposer.sequences["r"]
    stale, tag = seq.page_ids[0], seq.page_tags[0]
    proposer.pool.free([stale])  # behind the request's back: the tag moves on
    assert proposer.export_prompt("r", prompt) is None
    (violation,) = proposer.take_violations()
    assert (violation.request_id, violation.page_id, violation.expected_tag) == ("r", stale, tag)
    assert "r" not in proposer.sequences and proposer.take_violations() == []


def test_a_checkpoint_without_mtp_layers_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="no multi-token-prediction layer"):
        load_mtp_proposer(
            tiny_model_dir, ArchConfig.from_dir(tiny_model_dir), "float32", 8, PAGE_SIZE,
            select_backend("auto", CPU), CPU, 64,
        )  # fmt: skip


def test_with_mtp_on_greedy_output_is_unchanged(mtp_model_dir: Path) -> None:
    from densa.engine.llm import LLM
    from densa.sampling_params import SamplingParams

    prompts = [[5, 17, 230, 1234, 9, 88, 4021], [301, 302, 7, 7, 7, 12, 4000, 51, 6, 9, 10]]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine = dict(num_kv_pages=64, page_size=PAGE_SIZE, max_model_len=128)
    plain = [r.token_ids for r in LLM(str(mtp_model_dir), **engine).generate(prompts, greedy)]
    llm = LLM(str(mtp_model_dir), speculative_method="mtp", **engine)
    speculator = llm.engine.speculator
    assert speculator is not None and isinstance(speculator.proposer, MTPProposer)
    # The tiny target has 3 layers: its MTP layer (a fourth, with every expert's bytes) and
    # shared head cost about as much as a target step, so no guess would pay; priced as free
    # here, it proposes every step.
    assert speculator.proposer.cost_per_token > 0.5
    speculator.proposer.cost_per_token = 0.0
    assert [r.token_ids for r in llm.generate(prompts, greedy)] == plain
    assert speculator.num_proposed_tokens > 0
    assert speculator.proposer.sequences == {}  # released with their requests
    assert speculator.proposer.pool.num_free_pages == engine["num_kv_pages"]
