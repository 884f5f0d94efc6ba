"""Llama-attention mixture-of-experts families: Mixtral, Qwen2-MoE, Qwen3-MoE.

Each is Llama's decoder with some MLPs replaced by a sparse MoE block (densa.model.moe):

    family      routing                           shared expert               attention
    Mixtral     softmax top-k, renormalized       none                        Llama (GQA)
    Qwen2-MoE   softmax top-k (+ renorm option)   one, gated by sigmoid(x g)  q/k/v biases
    Qwen3-MoE   softmax top-k (+ renorm option)   none                        q/k head norms

Checkpoints store one tensor per expert (and Mixtral its own names: block_sparse_moe, w1/w3/w2
for gate/up/down); `normalize_checkpoint` renames and stacks them into the layout densa runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from densa.model.arch import ArchConfig
from densa.model.family_config import MoEConfig
from densa.model.layers import GatedMLP
from densa.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from densa.model.moe import (
    SparseMoeBlock,
    route_softmax,
    route_softmax_normalized,
    stack_experts,
)


class LlamaMoeForCausalLM(LlamaForCausalLM):
    """Llama's decoder with a sparse MoE block in the layers `cfg.moe` marks."""

    route = staticmethod(route_softmax)
    shared_gate = False  # whether the shared expert's output is gated per token

    def __init__(self, cfg: ArchConfig, max_position: int, device: torch.device) -> None:
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture} needs mixture-of-experts settings in its config")
        self.moe_cfg: MoEConfig = cfg.moe
        super().__init__(cfg, max_position, device)

    def make_layer(self, cfg: ArchConfig, layer_idx: int) -> LlamaDecoderLayer:
        mlp: nn.Module
        if self.moe_cfg.is_moe_layer(layer_idx):
            mlp = SparseMoeBlock(
                cfg.hidden_size, self.moe_cfg, cfg.hidden_act, type(self).route,
                shared_gate=self.shared_gate,
            )  # fmt: skip
        else:
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        return LlamaDecoderLayer(cfg, layer_idx, self.qk_norm, mlp)

    def normalize_checkpoint(self, tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        renamed = ((self.canonical_name(name), value) for name, value in tensors)
        return stack_experts(renamed, self.moe_cfg.num_experts)

    def canonical_name(self, hf_name: str) -> str:
        return hf_name


_MIXTRAL_NAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
    (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
    (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
)


class MixtralForCausalLM(LlamaMoeForCausalLM):
    route = staticmethod(route_softmax_normalized)

    def canonical_name(self, hf_name: str) -> str:
        for pattern, replacement in _MIXTRAL_NAMES:
            hf_name = pattern.sub(replacement, hf_name)
        return hf_name


class Qwen2MoeForCausalLM(LlamaMoeForCausalLM):
    shared_gate = True


class Qwen3MoeForCausalLM(LlamaMoeForCausalLM):
    qk_norm = True
