"""Copying Hugging Face-named checkpoint tensors into densa's parameters.

densa fuses projections that read the same input (q|k|v, gate|up) into one weight, so a
checkpoint tensor may fill a row range ("shard") of a parameter. Stacked expert weights add a
leading expert dimension; their shards are row ranges of every expert:

    parameter shape         rows are dim    checkpoint tensor fills
    [out] / [out, in...]    0               rows [lo, hi)
    [E, out, in...]         1               rows [lo, hi) of all E experts

Quantized parameters (qweight, scales, zeros, ...) keep one row per output feature in the same
dimension, so shards land in them the same way whatever the format.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

QKV_FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
GATE_UP_FUSED = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
FusedNames = dict[str, tuple[str, str]]


def fused_target(hf_name: str, fused: FusedNames) -> tuple[str, str | None]:
    """'model.layers.3.self_attn.k_proj.weight' -> ('layers.3.self_attn.qkv_proj.weight', 'k')."""
    parts = hf_name.removeprefix("model.").split(".")
    for idx, part in enumerate(parts):
        if part in fused:
            parts[idx], shard = fused[part]
            return ".".join(parts), shard
    return ".".join(parts), None


class FusedWeightLoader:
    """Loads a model whose fused projections follow `fused`; q/k/v shards take `qkv_sizes`
    rows, gate and up one half each. Every parameter must be filled exactly."""

    def __init__(
        self,
        fused: FusedNames,
        qkv_sizes: tuple[int, int, int] = (0, 0, 0),
        tied_head: bool = False,
    ) -> None:
        self.fused, self.tied_head = fused, tied_head
        q, k, v = qkv_sizes
        self._qkv_rows = {"q": (0, q), "k": (q, q + k), "v": (q + k, q + k + v)}

    def target(self, hf_name: str) -> str:
        return fused_target(hf_name, self.fused)[0]

    def load(self, model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(model.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name, shard = fused_target(hf_name, self.fused)
            if name.startswith("lm_head") and self.tied_head:
                continue  # tied: the embedding is the head
            if name not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no place in the model")
            self._copy_into(params[name], tensor, shard)
            loaded.add(f"{name}#{shard}")
        self._check_all_loaded(params, loaded)

    def _copy_into(self, param: nn.Parameter, tensor: torch.Tensor, shard: str | None) -> None:
        stacked = param.dim() == 3  # [experts, rows, ...]
        rows_dim = 1 if stacked else 0
        lo, hi = self._rows(shard, param.shape[rows_dim])
        target = param.data[:, lo:hi] if stacked else param.data[lo:hi]
        if target.shape != tensor.shape:
            raise ValueError(
                f"shape mismatch: checkpoint {tuple(tensor.shape)} vs model {tuple(target.shape)}"
            )
        target.copy_(tensor)

    def _rows(self, shard: str | None, num_rows: int) -> tuple[int, int]:
        if shard is None:
            return 0, num_rows
        if shard == "gate":
            return 0, num_rows // 2
        if shard == "up":
            return num_rows // 2, num_rows
        return self._qkv_rows[shard]

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        shards_of: dict[str, set[str | None]] = {}
        for fused, shard in self.fused.values():
            shards_of.setdefault(fused, set()).add(shard)
        expected = set()
        for name in params:
            # Any parameter of a fused projection (weight, quantized parts, bias) is filled
            # shard by shard.
            module = name.rpartition(".")[0].rpartition(".")[2]
            shards = shards_of.get(module, {None})
            expected |= {f"{name}#{shard}" for shard in shards}
        missing = sorted(expected - loaded)
        if missing:
            raise KeyError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
