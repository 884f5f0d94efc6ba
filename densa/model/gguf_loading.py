"""A GGUF file's linear layers loaded straight from its blocks into the CPU kernels' formats.

Which layers keep their blocks (`plan_kept_linears`): with a packed `--weight-format` (which
`auto` resolves to for a GGUF file whose layers are mostly of a mapped type, loader.AUTO_LINEAR),
each linear layer whose GGUF tensors (all shards of a fused q|k|v or gate|up) map onto one
kernel family (densa.quant.gguf_blocks) and whose shape the kernels tile. Its module is swapped
for an empty `PackedLinear` before the model is materialized; while the checkpoint streams in,
`BlockSink` takes those tensors out of the stream, decodes each shard's blocks, and once a
module's shards are all there, packs them (rows in fused order) into its blocks. Every other
tensor is dequantized to float32 one at a time and loaded as usual (the other linears are then
packed from float32 into the asked format, as for any dense checkpoint), so at no point is the
whole model held in float32.

    weight_format   kept layers, in order of preference
    w4a8            w4 family -> w4a8, else w8 family -> w8a8
    w8a8            w8 family -> w8a8, else w4 family -> w4a8
    w8              w8 family -> w8,   else w4 family -> w4a8
    any other       none (dense, int4, fp8; `auto` on a converted directory loads it dense,
                    as transformers reads it)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from densa.kernels import qgemm
from densa.model.arch import ModelLoadError
from densa.model.gguf import GGUFFile, GGUFTensor
from densa.model.interface import CausalLM
from densa.model.packed_linear import PackedLinear
from densa.model.weight_loading import GATE_UP_FUSED, QKV_FUSED, fused_target
from densa.quant import gguf_blocks

_FAMILY_FORMATS = {  # weight_format -> kernel family -> packed format, in preference order
    "w4a8": {"w4": "w4a8", "w8": "w8a8"},
    "w8a8": {"w8": "w8a8", "w4": "w4a8"},
    "w8": {"w8": "w8", "w4": "w4a8"},
}
_SHARD_ORDER = {None: 0, "q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}


@dataclass(frozen=True)
class KeptLinear:
    """A linear layer run from its GGUF blocks: its packed format and the kernel family its
    shards decode into."""

    fmt: str
    family: str
    exact: bool  # False where fp16 scales round the stored values (Q4_K)


def plan_kept_linears(
    model: CausalLM, types: dict[str, str], targets: set[str], weight_format: str
) -> dict[str, KeptLinear]:
    """Module name -> how it keeps its blocks, for the `targets` (quantizable linears) whose
    GGUF types (HF tensor name -> type name) allow it under `weight_format`."""
    formats = _FAMILY_FORMATS.get(weight_format, {})
    shard_types: dict[str, list[str]] = {}
    for name, type_name in types.items():
        module, _, param = model.checkpoint_target(name).rpartition(".")
        if param == "weight" and module in targets:
            shard_types.setdefault(module, []).append(type_name)
    plan = {}
    for module, kinds in shard_types.items():
        family = gguf_blocks.common_family(kinds, tuple(formats))
        layer = model.get_submodule(module)
        weight = getattr(layer, "weight", None)
        if family not in formats or weight is None:
            continue
        if not qgemm.fits(weight.shape[1], weight.shape[0]):
            continue
        exact = all(gguf_blocks.BLOCK_TYPES[k].is_exact(family) for k in kinds)
        plan[module] = KeptLinear(formats[family], family, exact)
    return plan


def swap_kept_linears(model: nn.Module, plan: dict[str, KeptLinear]) -> None:
    """Replace the planned (meta) dense modules by empty packed ones of the same shape."""
    for name, kept in plan.items():
        dense = model.get_submodule(name)
        out_features, in_features = getattr(dense, "weight").shape  # noqa: B009
        has_bias = getattr(dense, "bias", None) is not None
        model.set_submodule(name, PackedLinear.empty(kept.fmt, in_features, out_features, has_bias))


class BlockSink:
    """Collects the kept layers' GGUF tensors and packs each layer once its shards are in."""

    def __init__(self, model: nn.Module, plan: dict[str, KeptLinear]) -> None:
        self.model, self.plan = model, plan
        self._pending: dict[str, list[tuple[int, gguf_blocks.KernelGroups]]] = {}
        self._rows: dict[str, int] = {}
        self.done: set[str] = set()

    def take(self, hf_name: str, module: str | None, tensor: GGUFTensor) -> bool:
        """Consume the tensor if it is the weight (`module`: the layer it loads into, None for
        other parameters) of a kept layer (True), else leave it (False)."""
        kept = self.plan.get(module or "")
        if module is None or kept is None:
            return False
        shard = fused_target(hf_name, QKV_FUSED | GATE_UP_FUSED)[1]
        groups = gguf_blocks.decode(tensor.raw, tensor.type_name, kept.family, tensor.shape[1])
        self._pending.setdefault(module, []).append((_SHARD_ORDER[shard], groups))
        self._rows[module] = self._rows.get(module, 0) + tensor.shape[0]
        layer = self.model.get_submodule(module)
        if self._rows[module] == getattr(layer, "out_features"):  # noqa: B009
            self._install(module, layer)
        return True

    def _install(self, module: str, layer: nn.Module) -> None:
        parts = [groups for _, groups in sorted(self._pending.pop(module), key=lambda p: p[0])]
        codes = torch.from_numpy(_cat([p.codes for p in parts]))
        d = torch.from_numpy(_cat([p.d for p in parts]))
        fmt, isa = self.plan[module].fmt, getattr(layer, "isa")  # noqa: B009
        if fmt == "w4a8":
            m = torch.from_numpy(_cat([p.m for p in parts if p.m is not None]))
            packed = qgemm.pack_w4(codes, d, m, isa)
        elif fmt == "w8a8":
            packed = qgemm.pack_w8(codes, d, isa)
        else:
            packed = qgemm.pack_w8_float(codes, d, isa)
        blocks = getattr(layer, "blocks")  # noqa: B009
        blocks.copy_(packed.blocks)
        self.done.add(module)

    def finish(self) -> None:
        missing = sorted(set(self.plan) - self.done)
        if missing:
            raise ModelLoadError(
                f"the GGUF file lacks weights of {len(missing)} layers, e.g. {missing[:3]}"
            )


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.ascontiguousarray(np.concatenate(arrays, axis=0))


def gguf_checkpoint(
    source: GGUFFile, model: CausalLM, sink: BlockSink
) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors as the model loads them: kept layers' shards go to `sink` (packed as
    they complete), every other tensor is dequantized to float32, one at a time."""
    for name, tensor in source.tensors():
        module, _, param = model.checkpoint_target(name).rpartition(".")
        if not sink.take(name, module if param == "weight" else None, tensor):
            yield name, tensor.dequantize()
    sink.finish()
