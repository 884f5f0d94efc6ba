"""Which modules a quantized weight format replaces, by their role in the model's structure.

role              modules                                    quantized
linear            attention and dense MLP projections       yes, unless experts_only
routed experts    StackedLinear of an MoE block              yes
shared experts    an MoE block's shared_expert MLP           unless keep_shared_experts
output head       lm_head                                    only with include_head
kept dense        MoE routers (not Linear modules), shared   never: tiny, and their rounding
                  expert gates [hidden -> 1], MLA kv_b_proj  changes which experts run, or
                  (absorbed into decode's query/output),     (kv_b_proj) decode needs the
                  DSA indexers' per-head weights,            plain matrix; (weights_proj)
                  weights tied to an embedding               it decides which tokens attend
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from densa.model.dsa import Indexer
from densa.model.linear import Linear
from densa.model.mla import MLAttention
from densa.model.moe import SparseMoeBlock
from densa.model.stacked_linear import StackedLinear

OUTPUT_HEAD = "lm_head"  # kept in high precision unless asked (it shapes every logit)


@dataclass(frozen=True)
class QuantScope:
    include_head: bool = False  # quantize an untied output head too
    keep_shared_experts: bool = False  # MoE: shared experts stay in high precision
    experts_only: bool = False  # MoE: only the routed experts (attention etc. stay dense)


def quantization_targets(model: nn.Module, scope: QuantScope = QuantScope()) -> set[str]:
    """Names of the Linear / StackedLinear modules `scope` quantizes."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    dense_only, shared = _kept_dense(model), _shared_expert_prefixes(model)
    targets = set()
    for name, module in model.named_modules():
        if isinstance(module, StackedLinear):
            targets.add(name)
            continue
        if not isinstance(module, Linear) or id(module.weight) in embeddings:
            continue
        if name in dense_only or (name == OUTPUT_HEAD and not scope.include_head):
            continue
        if scope.experts_only or (scope.keep_shared_experts and name.startswith(shared)):
            continue
        targets.add(name)
    return targets


def _kept_dense(model: nn.Module) -> set[str]:
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, MLAttention):
            names.add(f"{name}.kv_b_proj")
        elif isinstance(module, Indexer):
            names.add(f"{name}.weights_proj")
        elif isinstance(module, SparseMoeBlock) and module.shared_expert_gate is not None:
            names.add(f"{name}.shared_expert_gate")
    return names


def _shared_expert_prefixes(model: nn.Module) -> tuple[str, ...]:
    return tuple(
        f"{name}.shared_expert."
        for name, module in model.named_modules()
        if isinstance(module, SparseMoeBlock) and module.shared_expert is not None
    )
