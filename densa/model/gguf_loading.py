"""A GGUF file's linear layers loaded straight from its blocks into the CPU kernels' formats.

Which layers keep their blocks (`plan_kept_linears`): each linear layer (and an untied output
head) whose GGUF tensors map onto a kernel family (densa.quant.gguf_blocks) under the asked
`--weight-format`, and whose shape the kernels tile. A fused q|k|v or gate|up whose shards map
onto one family is one `PackedLinear`; one whose shards need different families (Q4_K_M files
store some layers' v as Q6_K beside Q4_K q and k) is a `ShardedPackedLinear`, each shard in its
own format. Planned modules are swapped for empty packed ones before the model is materialized;
while the checkpoint streams in, `BlockSink` takes their tensors out of the stream, decodes each
shard's blocks and packs it into its place. Every other tensor is dequantized to float32 one at
a time and loaded as usual (the other linears are then packed from float32 into the asked
format, as for any dense checkpoint), so at no point is the whole model held in float32.

    weight_format   kept layers: kernel family -> packed format, in order of preference
    blocks          w4 -> w4a8, w5 -> w5a8, w5m -> w5ma8, w6 -> w6a8, w6m -> w6ma8, w8 -> w8
                    (weight-only: Q8_0 exactly, float x); what `auto` resolves a GGUF file to
                    (loader.auto_formats)
    w4a8            as blocks, but w8 -> w8a8
    w8a8            w8 -> w8a8, then w5, w5m, w6, w6m, w4 as blocks
    w8              w8 -> w8,   then w5, w5m, w6, w6m, w4 as blocks
    any other       none (dense, int4, fp8)

Each GGUF type takes the first family it maps onto (gguf_blocks.BLOCK_TYPES): Q5_0 and Q3_K
w5a8, Q5_1 and Q5_K w5ma8, Q6_K w6a8.

Linear weights of a type no family holds (Q2_K, most IQ*) are dequantized; `dequantized_types`
says which and what they cost, for the loader's one warning per file.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import nn

from densa.kernels.cpu import qgemm
from densa.model.arch import ModelLoadError
from densa.model.gguf import GGUFFile
from densa.model.gguf_tensors import GGUFTensor
from densa.model.interface import CausalLM
from densa.model.packed_linear import (
    PackedLinear,
    ShardedPackedLinear,
    packed_bytes,
    packed_format,
)
from densa.model.quantized_embedding import GGUFEmbedding
from densa.model.weight_loading import GATE_UP_FUSED, QKV_FUSED, fused_target
from densa.quant import gguf_blocks
from densa.quant.linear_format import LinearFormat
from densa.utils.sizes import format_bytes

_SPLIT_FORMATS = {"w5": "w5a8", "w5m": "w5ma8", "w6": "w6a8", "w6m": "w6ma8"}
# LinearFormat -> kernel family -> packed kernel format, in preference order; a format not
# listed keeps no blocks (the table in the module's docstring).
_FAMILY_FORMATS: dict[LinearFormat, dict[str, str]] = {
    LinearFormat.BLOCKS: {"w4": "w4a8", **_SPLIT_FORMATS, "w8": "w8"},
    LinearFormat.W4A8: {"w4": "w4a8", **_SPLIT_FORMATS, "w8": "w8a8"},
    LinearFormat.W8A8: {"w8": "w8a8", **_SPLIT_FORMATS, "w4": "w4a8"},
    LinearFormat.W8: {"w8": "w8", **_SPLIT_FORMATS, "w4": "w4a8"},
}
# What each packed format's pack function takes after (codes, d), of a block decoder's groups:
# a per-group min (m) and/or sub-block scales (sc).
_GROUP_PARTS = {"w4a8": ("m",), "w5a8": ("sc",), "w6a8": ("sc",), "w5ma8": ("sc", "m"),
                "w6ma8": ("sc", "m"), "w8a8": (), "w8": ()}  # fmt: skip
_SHARD_ORDER = {None: 0, "q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}
_DENSE_TYPES = {"F32", "F16", "BF16"}


@dataclass(frozen=True)
class KeptLinear:
    """A linear layer run from its GGUF blocks: per shard (in fused order: q, k, v or gate, up;
    one for an unfused layer) its packed format, kernel family and output rows."""

    fmts: tuple[str, ...]
    families: tuple[str, ...]
    rows: tuple[int, ...]
    exact: bool  # False where fp16 scales round the stored values (Q4_K, Q5_K, IQ4_XS)

    @property
    def sharded(self) -> bool:
        return len(set(self.fmts)) > 1

    @property
    def fmt(self) -> str:
        """The layer's format ("w4a8|w6a8" for a sharded one)."""
        return "|".join(dict.fromkeys(self.fmts))

    def packed_bytes(self, in_features: int) -> int:
        pairs = zip(self.fmts, self.rows, strict=True)
        return sum(packed_bytes(fmt, rows, in_features) for fmt, rows in pairs)


def plan_kept_linears(
    model: CausalLM,
    layouts: dict[str, tuple[str, int]],
    targets: set[str],
    weight_format: LinearFormat,
) -> dict[str, KeptLinear]:
    """Module name -> how it keeps its blocks, for the `targets` (quantizable linears) whose
    GGUF tensors (HF name -> (type name, rows)) allow it under `weight_format`."""
    formats = _FAMILY_FORMATS.get(weight_format, {})
    shards: dict[str, list[tuple[int, str, int]]] = {}  # module -> [(order, type, rows)]
    for name, (type_name, rows) in layouts.items():
        module, _, param = model.checkpoint_target(name).rpartition(".")
        if param == "weight" and module in targets:
            shards.setdefault(module, []).append((_shard_order(name), type_name, rows))
    plan = {}
    for module, parts in shards.items():
        kept = _plan_layer(model.get_submodule(module), sorted(parts), formats)
        if kept is not None:
            plan[module] = kept
    return plan


def _shard_order(hf_name: str) -> int:
    return _SHARD_ORDER[fused_target(hf_name, QKV_FUSED | GATE_UP_FUSED)[1]]


def _plan_layer(
    layer: nn.Module, parts: list[tuple[int, str, int]], formats: dict[str, str]
) -> KeptLinear | None:
    """One family for all shards if they share one, else each shard's own (sharded)."""
    weight = getattr(layer, "weight", None)
    if weight is None or not qgemm.fits(weight.shape[1], weight.shape[0]):
        return None
    kinds = [kind for _, kind, _ in parts]
    rows = tuple(r for _, _, r in parts)
    if sum(rows) != weight.shape[0]:
        return None  # a shard is missing from the file: loaded dense, which refuses it
    if any(r % qgemm.PANEL for r in rows):
        return None  # shards are packed into whole panels of rows
    order = tuple(formats)
    common = gguf_blocks.common_family(kinds, order)
    if common is not None:
        chosen = (common,) * len(kinds)
    else:  # each shard in its own format
        own = [gguf_blocks.common_family([kind], order) for kind in kinds]
        if any(f is None for f in own):
            return None
        chosen = tuple(str(f) for f in own)
    exact = all(gguf_blocks.BLOCK_TYPES[k].is_exact(f) for k, f in zip(kinds, chosen, strict=True))
    return KeptLinear(tuple(formats[f] for f in chosen), chosen, rows, exact)


@dataclass(frozen=True)
class DequantizedType:
    """The linear weights of one GGUF type that load as float32 instead of their blocks."""

    type_name: str
    num_tensors: int
    file_bytes: int
    float_bytes: int
    mapped: bool  # the type has a kernel family (the layer's shape or shards kept it out)


def dequantized_types(
    model: CausalLM,
    layouts: dict[str, tuple[str, int]],
    targets: set[str],
    plan: dict[str, KeptLinear],
) -> list[DequantizedType]:
    """The quantized GGUF types of the `targets`' weights (quantizable linears) that the kept
    `plan` leaves out, with their bytes in the file and as float32, most costly first."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    totals: dict[str, list[int]] = {}  # type -> [tensors, file bytes, float32 bytes]
    for name, (type_name, rows) in layouts.items():
        module, _, param = model.checkpoint_target(name).rpartition(".")
        if param != "weight" or module not in targets or module in plan:
            continue
        if type_name in _DENSE_TYPES:
            continue
        cols = getattr(model.get_submodule(module), "weight").shape[1]  # noqa: B009
        block_len, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
        total = totals.setdefault(type_name, [0, 0, 0])
        total[0] += 1
        total[1] += rows * cols // block_len * block_bytes
        total[2] += rows * cols * 4
    found = [
        DequantizedType(kind, n, file, dense, kind in gguf_blocks.BLOCK_TYPES)
        for kind, (n, file, dense) in totals.items()
    ]
    return sorted(found, key=lambda t: t.file_bytes - t.float_bytes)


def dequantized_message(found: list[DequantizedType], weight_format: LinearFormat) -> str | None:
    """The loader's one warning about `found`, or None (nothing found, or `weight_format`
    keeps no blocks at all: dense was asked)."""
    if not found or weight_format not in _FAMILY_FORMATS:
        return None
    parts = []
    for kind in found:
        why = "kept out by its layer's shape or shards" if kind.mapped else "no kernel runs it"
        parts.append(
            f"{kind.type_name} ({kind.num_tensors} tensors, {why}: "
            f"{format_bytes(kind.file_bytes)} in the file -> {format_bytes(kind.float_bytes)})"
        )
    extra = sum(kind.float_bytes - kind.file_bytes for kind in found)
    after = (
        f"they stay float32, {format_bytes(extra)} more than their blocks"
        if weight_format.is_gguf_blocks
        else f"{weight_format} then re-quantizes them from float32 (not the file's values)"
    )
    return (
        f"GGUF linear weights dequantized to float32 at load: {', '.join(parts)}; {after}. "
        f"The CPU kernels run {', '.join(gguf_blocks.BLOCK_TYPES)} from their blocks "
        "(docs/models.md, GGUF block types)"
    )


def swap_kept_linears(model: nn.Module, plan: dict[str, KeptLinear]) -> None:
    """Replace the planned (meta) dense modules by empty packed ones of the same shape."""
    for name, kept in plan.items():
        dense = model.get_submodule(name)
        out_features, in_features = getattr(dense, "weight").shape  # noqa: B009
        has_bias = getattr(dense, "bias", None) is not None
        packed: nn.Module
        if kept.sharded:
            packed = ShardedPackedLinear.empty(kept.fmts, in_features, kept.rows, has_bias)
        else:
            packed = PackedLinear.empty(kept.fmts[0], in_features, out_features, has_bias)
        model.set_submodule(name, packed)


EMBEDDING_TENSOR = "model.embed_tokens.weight"  # token_embd.weight in HF naming


@dataclass(frozen=True)
class KeptEmbedding:
    """The token embedding kept in its GGUF blocks (densa.model.quantized_embedding)."""

    module: str
    type_name: str
    num_embeddings: int
    embedding_dim: int


def plan_kept_embedding(
    model: CausalLM, layouts: dict[str, tuple[str, int]], tied: bool
) -> KeptEmbedding | None:
    """Keep a quantized embedding's blocks, unless the output head shares its weight (a tied
    head multiplies by the whole table every step: it needs a kernel format)."""
    if tied or EMBEDDING_TENSOR not in layouts:
        return None
    type_name, rows = layouts[EMBEDDING_TENSOR]
    module = model.checkpoint_target(EMBEDDING_TENSOR).rpartition(".")[0]
    layer = model.get_submodule(module)
    if type_name in _DENSE_TYPES or not isinstance(layer, nn.Embedding):
        return None
    return KeptEmbedding(module, type_name, rows, layer.embedding_dim)


def swap_kept_embedding(model: nn.Module, kept: KeptEmbedding | None) -> None:
    if kept is None:
        return
    row_bytes = GGUFEmbedding.row_bytes(kept.type_name, kept.embedding_dim)
    table = GGUFEmbedding(kept.type_name, kept.num_embeddings, kept.embedding_dim, row_bytes)
    model.set_submodule(kept.module, table)


class BlockSink:
    """Takes the kept layers' GGUF tensors out of the stream and packs each shard into its rows
    of the layer's blocks at once, a few thousand rows at a time (a panel-major layout puts rows
    [r0, r1) in one run of blocks), so no layer is ever decoded whole: the 1.5B's Q6_K output
    head alone would need ~1 GB of temporaries."""

    def __init__(
        self, model: nn.Module, plan: dict[str, KeptLinear], embedding: KeptEmbedding | None = None
    ) -> None:
        self.model, self.plan, self.embedding = model, plan, embedding
        self._rows: dict[str, int] = {}
        self.done: set[str] = set()

    def take(self, hf_name: str, module: str | None, tensor: GGUFTensor) -> bool:
        """Consume the tensor if it is the weight (`module`: the layer it loads into, None for
        other parameters) of a kept layer or the kept embedding (True), else leave it."""
        if self.embedding is not None and module == self.embedding.module:
            table = cast(GGUFEmbedding, self.model.get_submodule(module))
            table.blocks.numpy()[:] = tensor.raw
            self.done.add(module)
            return True
        kept = self.plan.get(module or "")
        if module is None or kept is None:
            return False
        order = _shard_order(hf_name)
        layer = self.model.get_submodule(module)
        target: nn.Module = layer  # the shards of a fused layer are row ranges of one module
        first_row = sum(kept.rows[:order])
        if kept.sharded:  # each shard is a module of its own
            target, first_row = cast(ShardedPackedLinear, layer).packed_shards[order], 0
        _pack_rows(target, kept.fmts[order], kept.families[order], tensor, first_row)
        self._rows[module] = self._rows.get(module, 0) + tensor.shape[0]
        if self._rows[module] == sum(kept.rows):
            self.done.add(module)
        return True

    def finish(self) -> None:
        expected = set(self.plan) | ({self.embedding.module} if self.embedding else set())
        missing = sorted(expected - self.done)
        if missing:
            raise ModelLoadError(
                f"the GGUF file lacks weights of {len(missing)} layers, e.g. {missing[:3]}"
            )


_ROWS_PER_CHUNK = 2048  # a multiple of the 16-row panel


def _pack_rows(layer: nn.Module, fmt: str, family: str, tensor: GGUFTensor, first_row: int) -> None:
    """Decode the tensor's blocks and pack them into `layer`'s rows from `first_row` on."""
    blocks = getattr(layer, "blocks")  # noqa: B009
    in_features = tensor.shape[1]
    row_bytes = packed_bytes(fmt, qgemm.PANEL, in_features) // qgemm.PANEL
    for lo in range(0, tensor.shape[0], _ROWS_PER_CHUNK):
        raw = tensor.raw[lo : lo + _ROWS_PER_CHUNK]
        groups = gguf_blocks.decode(raw, tensor.type_name, family, in_features)
        packed = _pack(groups, fmt, getattr(layer, "isa")).blocks  # noqa: B009
        start = (first_row + lo) * row_bytes
        blocks[start : start + packed.numel()].copy_(packed)


def _pack(groups: gguf_blocks.KernelGroups, fmt: str, isa: str) -> qgemm.PackedWeight:
    """Decoded blocks -> the kernels' blocks, by the packed format's own pack function, with the
    parts of the groups that format keeps (_GROUP_PARTS)."""
    codes, d = torch.from_numpy(groups.codes), torch.from_numpy(groups.d)
    extra = [torch.from_numpy(_present(getattr(groups, part))) for part in _GROUP_PARTS[fmt]]
    return packed_format(fmt).pack(codes, d, *extra, isa)


def _present(array: np.ndarray | None) -> np.ndarray:
    if array is None:
        raise ValueError("a block decoder left out a part its kernel format needs")
    return np.ascontiguousarray(array)


def gguf_checkpoint(
    source: GGUFFile, model: CausalLM, sink: BlockSink
) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors as the model loads them: kept layers' shards go to `sink` (packed as
    they complete), every other tensor is dequantized to float32, one at a time."""
    for name, tensor in source.tensors():
        module, _, param = model.checkpoint_target(name).rpartition(".")
        if not sink.take(name, module if param == "weight" else None, tensor):
            yield name, tensor.dequantize()
        source.release(tensor.raw)  # read once: its file pages need not stay in this process
    sink.finish()
