"""Mixture-of-experts MLPs: routers, stacked experts, shared experts.

A token's MLP output is a weighted sum of the k experts its router picks (Shazeer et al. 2017;
Mixtral, Jiang et al. 2024), plus, in some families, shared experts every token runs:

    y = sum_{e in topk(x)} w_e(x) * expert_e(x)  [+ shared(x)]

Routing, by family (the registry's model class picks one):
- softmax top-k (Mixtral, Qwen2-MoE, Qwen3-MoE): w = softmax(x G^T) restricted to the top k,
  renormalized to sum 1 when norm_topk_prob (always for Mixtral);
- DeepSeek-V3 (DeepSeek-AI 2024, sec. 2.1.2): s = sigmoid(x G^T); choice by s + b (a bias
  learned for load balance, not used in the weights), only within the `topk_groups` groups with
  the best top-2 sums; w = s of the chosen experts, renormalized, times `routed_scaling_factor`.

Computation (never a loop over tokens): the (token, expert) pairs are sorted by expert, each
active expert's projections run once over its rows (densa.kernels.cpu.grouped_linear), the outputs
are scaled by their routing weights and summed back per token.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from densa.kernels.cpu.grouped_linear import sort_by_expert
from densa.model.family_config import MoEConfig
from densa.model.layers import GatedMLP, activation
from densa.model.linear import Linear
from densa.model.stacked_linear import StackedLinear
from densa.quant.checkpoint import Converted

Routing = tuple[torch.Tensor, torch.Tensor]  # (weights [T, k] float32, expert ids [T, k] int64)


class Router(nn.Module):
    """The gate: router logits x G^T in float32, G: [experts, hidden]. Kept in high precision in
    every weight format: it is tiny, and its rounding error would change which experts run."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        # DeepSeek-V3's load-balancing bias (added to scores for the choice only).
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts), requires_grad=False) if correction_bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())  # [T, experts]


def softmax_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> Routing:
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_sigmoid_topk(logits: torch.Tensor, bias: torch.Tensor, cfg: MoEConfig) -> Routing:
    scores = logits.sigmoid()  # [T, E]
    choice = scores + bias.float()
    num_tokens = scores.shape[0]
    per_group = choice.view(num_tokens, cfg.num_groups, -1)  # [T, groups, E / groups]
    group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(cfg.topk_groups, dim=-1).indices  # [T, topk_groups]
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    choice = choice.masked_fill(~allowed.repeat_interleave(per_group.shape[-1], dim=1), -1e30)
    ids = choice.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


class StackedExperts(nn.Module):
    """E gated MLPs with stacked weights: gate|up [E, 2I, H], down [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = StackedLinear(num_experts, hidden_size, 2 * intermediate_size)
        self.down_proj = StackedLinear(num_experts, intermediate_size, hidden_size)
        self.act = activation(act)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x: [T, H] -> sum over each token's k experts of weight * expert(x): [T, H]."""
        weights, expert_ids = routing  # [T, k] each
        num_tokens, top_k = expert_ids.shape
        order, token_of_row, segments = sort_by_expert(expert_ids, self.num_experts)
        # index_select rather than x[...] / index_add_: on small decode batches torch runs the
        # latter as parallel regions, which cost milliseconds when the cores are oversubscribed.
        rows = x.index_select(0, token_of_row)  # [T * k, H]: each token once per expert, by expert
        gate, up = self.gate_up_proj(rows, segments).chunk(2, dim=-1)  # [T * k, I] each
        out = self.down_proj(self.act(gate) * up, segments)  # [T * k, H], sorted by expert
        out = out * weights.reshape(-1).index_select(0, order).unsqueeze(1).to(out.dtype)
        by_pair = out.index_select(0, torch.argsort(order))  # row t * k + j: token t, choice j
        return by_pair.view(num_tokens, top_k, -1).sum(dim=1)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ shared experts, optionally gated by a sigmoid per token)."""

    def __init__(
        self,
        hidden_size: int,
        cfg: MoEConfig,
        act: str,
        route: Callable[[SparseMoeBlock, torch.Tensor], Routing],
        correction_bias: bool = False,
        shared_gate: bool = False,
    ) -> None:
        super().__init__()
        self.cfg, self.route = cfg, route
        self.gate = Router(hidden_size, cfg.num_experts, correction_bias)
        self.experts = StackedExperts(
            cfg.num_experts, hidden_size, cfg.expert_intermediate_size, act
        )
        width = cfg.shared_intermediate_size
        self.shared_expert = GatedMLP(hidden_size, width, act) if width else None
        self.shared_expert_gate = Linear(hidden_size, 1) if width and shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.route(self, x))
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:  # Qwen2-MoE: sigmoid(x g) * shared(x)
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared


def route_softmax(block: SparseMoeBlock, x: torch.Tensor) -> Routing:
    return softmax_topk(block.gate(x), block.cfg.top_k, block.cfg.norm_topk_prob)


def route_softmax_normalized(block: SparseMoeBlock, x: torch.Tensor) -> Routing:
    return softmax_topk(block.gate(x), block.cfg.top_k, normalize=True)  # Mixtral


def route_grouped_sigmoid(block: SparseMoeBlock, x: torch.Tensor) -> Routing:
    bias = block.gate.e_score_correction_bias
    assert bias is not None  # built with correction_bias=True for this routing
    return grouped_sigmoid_topk(block.gate(x), bias, block.cfg)


# ---- checkpoints: per-expert tensors -> stacked ------------------------------------------------
_EXPERT_WEIGHT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


def stack_experts(
    tensors: Iterator[tuple[str, object]], num_experts: int
) -> Iterator[tuple[str, object]]:
    """'...experts.7.gate_proj.weight' (one [out, in] per expert, as checkpoints store them) ->
    '...experts.gate_proj.weight' [E, out, in], yielded once all E experts have been read.
    A shipped quantized checkpoint's experts (`Converted` parts) stack part by part."""
    pending: dict[str, dict[int, torch.Tensor | Converted]] = {}
    for name, value in tensors:
        match = _EXPERT_WEIGHT.match(name)
        if match is None or not isinstance(value, torch.Tensor | Converted):
            yield name, value
            continue
        stacked_name = f"{match['prefix']}.{match['proj']}.weight"
        experts = pending.setdefault(stacked_name, {})
        experts[int(match["expert"])] = value
        if len(experts) == num_experts:
            del pending[stacked_name]
            yield stacked_name, _stack([experts[e] for e in range(num_experts)])
    if pending:
        name, experts = next(iter(pending.items()))
        raise KeyError(f"checkpoint has {len(experts)} of {num_experts} experts for {name}")


def _stack(values: list[torch.Tensor | Converted]) -> torch.Tensor | Converted:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(values)  # type: ignore[arg-type]
    parts = [v.parts for v in values if isinstance(v, Converted)]
    return Converted({part: torch.stack([p[part] for p in parts]) for part in first.parts})
