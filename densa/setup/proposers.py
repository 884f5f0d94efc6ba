"""The proposer of speculative tokens the config names (docs/speculative.md), built next to the
target: a draft model shares its KV geometry and format, the MTP layer its checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from densa.config import DRAFT_METHODS, CacheConfig, ModelConfig, SpeculativeConfig
from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig
from densa.model.attention import AttentionBackend
from densa.model.linear import resident_weight_bytes
from densa.model.loader import resolve_model_dir
from densa.quant.linear_format import LinearFormat
from densa.spec.draft import DraftModelProposer, DraftSpec, draft_kv_format, load_draft_proposer
from densa.spec.lookup_first import LookupFirstProposer
from densa.spec.mtp import load_mtp_proposer
from densa.spec.ngram import NgramProposer
from densa.spec.proposer import Proposer
from densa.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class DraftTarget:
    """What a proposer is built next to: the target's model, its sized KV cache and device."""

    model: ModelConfig
    cache: CacheConfig  # sized: num_pages is the target's KV pages
    device: torch.device
    arch: ArchConfig
    tokenizer: Tokenizer
    backend: AttentionBackend
    kv_format: KVFormat
    weight_bytes: int  # the target's resident weights (a decode step streams them all)


# A context token the draft catches up on costs about this share of one of its guesses
# (weight share x this = target decode steps a token). Measured on the 2-core AVX-512 dev
# machine with the 0.5B Q4_K_M draft of the 1.5B (weight share 0.42, target step ~42 ms): in the
# serving engine a draft's first proposal on a 204-token prompt added 952 ms to TTFT, ~810 ms of
# it the catch-up (8 draft decode steps the rest): 3.95 ms a token, 0.094 of a target step,
# 0.22 of a guess. (The same model prefilling 200 tokens on its own took 533 ms, 0.15: the
# draft's catch-up runs with float32 KV pages and a proposal's bookkeeping.)
PREFILL_TOKEN_SHARE = 0.22


def build_proposer(config: SpeculativeConfig | None, target: DraftTarget) -> Proposer | None:
    """The proposer of speculative tokens the config names (docs/speculative.md), with the
    cost per proposed token the config gives, if any, instead of the estimate (and its
    catch-up cost in proportion)."""
    if config is None:
        return None
    proposer = _build_proposer(config, target)
    if config.proposer_cost is not None:
        proposer.cost_per_token = config.proposer_cost
    if isinstance(proposer, DraftModelProposer):  # a context token in proportion to a guess
        proposer.catch_up_cost_per_token = proposer.cost_per_token * PREFILL_TOKEN_SHARE
    return proposer


def _build_proposer(config: SpeculativeConfig, target: DraftTarget) -> Proposer:
    if config.method == "ngram":
        return NgramProposer()
    if config.method in DRAFT_METHODS and config.model is not None:
        draft = build_draft_proposer(config.model, config.num_tokens, target)
        draft.cost_per_token = weight_share(draft.model, target)
        if config.method == "ngram+draft":
            return LookupFirstProposer(NgramProposer(), draft)
        return draft
    if config.method == "mtp":
        model, cache = target.model, target.cache
        mtp = load_mtp_proposer(
            resolve_model_dir(model.model), target.arch, model.dtype, cache.num_pages,
            cache.page_size, target.backend, target.device,
            model.max_model_len + config.num_tokens,
        )  # fmt: skip
        mtp.cost_per_token = weight_share(mtp.layer, target)
        return mtp
    raise ValueError(f"speculative method {config.method!r} is not available in this build")


def weight_share(module: nn.Module, target: DraftTarget) -> float:
    """A proposer's pass relative to a target decode step, as the bytes of weights each
    streams: at the batch sizes that speculate, a decode step's time is about its weights'
    bytes (a 0.5B Q4_K_M draft for the 1.5B: 0.42)."""
    return streamed_weight_bytes(module) / max(1, target.weight_bytes)


def streamed_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights a decode step reads whole: all but the embedding table, of which
    it reads one row per token (a head tied to it is a module of its own and counts)."""
    own = sum(t.numel() * t.element_size() for t in model.parameters(recurse=False))
    return own + sum(
        resident_weight_bytes(child)
        for name, child in model.named_children()
        if name != "embed_tokens"
    )


def build_draft_proposer(model: str, num_tokens: int, target: DraftTarget) -> DraftModelProposer:
    """The draft model with as many KV pages as the target has (same page size): every token the
    target holds can have its draft counterpart, so the draft never runs out first. Its bytes
    come out of the same KV budget (see kv_sizing.resolve_num_pages); its KV format is the
    target's."""
    config, cache = target.model, target.cache
    spec = DraftSpec(
        model, cache.page_size, cache.num_pages, config.max_model_len + num_tokens, config.dtype,
        weight_format=LinearFormat.of(config.weight_format).for_draft(),
        kv_format=draft_kv_format(target.kv_format),
    )  # fmt: skip
    return load_draft_proposer(spec, target.arch, target.tokenizer, target.backend, target.device)
