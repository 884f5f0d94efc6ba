"""The proposer of speculative tokens the config names (docs/speculative.md), built next to the
target: a draft model shares its KV geometry and format, the MTP layer its checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from densa.config import CacheConfig, ModelConfig, SpeculativeConfig
from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig
from densa.model.attention import AttentionBackend
from densa.model.loader import resolve_model_dir
from densa.model.packed_linear import PACKED_FORMATS
from densa.spec.draft import DraftModelProposer, DraftSpec, load_draft_proposer
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


def build_proposer(config: SpeculativeConfig | None, target: DraftTarget) -> Proposer | None:
    """The proposer of speculative tokens the config names (docs/speculative.md)."""
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer()
    if config.method == "draft" and config.model is not None:
        return build_draft_proposer(config.model, config.num_tokens, target)
    if config.method == "mtp":
        model, cache = target.model, target.cache
        return load_mtp_proposer(
            resolve_model_dir(model.model), target.arch, model.dtype, cache.num_pages,
            cache.page_size, target.backend, target.device,
            model.max_model_len + config.num_tokens,
        )  # fmt: skip
    raise ValueError(f"speculative method {config.method!r} is not available in this build")


def build_draft_proposer(model: str, num_tokens: int, target: DraftTarget) -> DraftModelProposer:
    """The draft model with as many KV pages as the target has (same page size): every token the
    target holds can have its draft counterpart, so the draft never runs out first. Its bytes
    come out of the same KV budget (see kv_sizing.resolve_num_pages); its KV format is the
    target's."""
    config, cache = target.model, target.cache
    spec = DraftSpec(
        model, cache.page_size, cache.num_pages, config.max_model_len + num_tokens, config.dtype,
        weight_format=config.weight_format if config.weight_format in PACKED_FORMATS else "auto",
        kv_cache_dtype=target.kv_format.name,
    )  # fmt: skip
    return load_draft_proposer(spec, target.arch, target.tokenizer, target.backend, target.device)
