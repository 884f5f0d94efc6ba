"""Quantized checkpoints on disk: quantize a stream of tensors, write them with their format in
the safetensors metadata, and read them back grouped by logical tensor.

A stream of checkpoint tensors is `(name, value)` pairs in Hugging Face naming, where a value is
a dense tensor or, for a quantized weight, a `Quantized` (its parts and its logical shape).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from densa.quant.quantizer import Parts, WeightQuantizer
from densa.quant.weight_format import CheckpointFormat, StoredTensor, part_name

WEIGHTS_FILE = "model.safetensors"


@dataclass
class Quantized:
    """One quantized weight in a stream: its stored parts and its logical shape ([out, in], or
    [experts, out, in] for stacked expert weights)."""

    parts: Parts
    shape: tuple[int, ...]


@dataclass
class Converted:
    """One weight already in the parts its runtime layer takes (a shipped checkpoint's weight,
    converted by densa.quant.shipped); per-expert ones are stacked like dense tensors."""

    parts: Parts


Value = torch.Tensor | Quantized


def read_format(files: list[Path]) -> CheckpointFormat | None:
    """The `densa.weights` metadata of a (possibly sharded) checkpoint; None if it is dense."""
    from safetensors import safe_open

    merged: CheckpointFormat | None = None
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            found = CheckpointFormat.from_metadata(handle.metadata())
        if found is None:
            continue
        if merged is None:
            merged = found
        else:
            merged.merge(found)
    return merged


def group_parts(
    raw: Iterable[tuple[str, torch.Tensor]], ckpt: CheckpointFormat | None
) -> Iterator[tuple[str, Value]]:
    """Raw file tensors -> logical tensors: the parts of a quantized weight come out as one dict,
    as soon as its last part has been read (the writer keeps all parts in one file)."""
    if ckpt is None:
        yield from raw
        return
    owner = {
        stored: (name, part)
        for name, tensor in ckpt.tensors.items()
        for part, stored in tensor.parts.items()
    }
    pending: dict[str, Parts] = {}
    for file_name, tensor in raw:
        if file_name not in owner:
            yield file_name, tensor
            continue
        name, part = owner[file_name]
        parts = pending.setdefault(name, {})
        parts[part] = tensor
        if len(parts) == len(ckpt.tensors[name].parts):
            yield name, Quantized(pending.pop(name), ckpt.tensors[name].shape)
    if pending:
        raise ValueError(f"checkpoint is missing parts of {sorted(pending)[:3]}")


def quantize_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    quantizer: WeightQuantizer,
    is_target: Callable[[str], bool],
    hessian_of: Callable[[str], torch.Tensor | None] | None = None,
    keep_dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, Value]]:
    """Quantize the weights `is_target` selects (2-D, or stacked 3-D experts; with their input
    Hessian, if the method needs one); pass the rest through, cast to `keep_dtype` if given
    (embeddings, norms)."""
    for name, tensor in tensors:
        if is_target(name):
            hessian = None if hessian_of is None else hessian_of(name)
            shape = tuple(int(d) for d in tensor.shape)
            yield name, Quantized(quantizer.quantize(tensor, hessian), shape)
        elif keep_dtype is not None and tensor.is_floating_point():
            yield name, tensor.to(keep_dtype)
        else:
            yield name, tensor


def write_checkpoint(
    out_dir: Path,
    tensors: Iterable[tuple[str, Value]],
    ckpt: CheckpointFormat | None,
    extra_metadata: dict[str, str] | None = None,
) -> Path:
    """Save one safetensors file; quantized tensors are stored as '<name>.<part>' and listed,
    with their shapes, in the `densa.weights` metadata (ckpt.tensors is filled here);
    `extra_metadata` (the source's lineage) is stored beside it."""
    from safetensors.torch import save_file

    flat: dict[str, torch.Tensor] = {}
    for name, value in tensors:
        if isinstance(value, torch.Tensor):
            flat[name] = value.contiguous()
            continue
        if ckpt is None:
            raise ValueError("quantized tensors need a checkpoint format")
        parts = {part: part_name(name, part) for part in value.parts}
        ckpt.tensors[name] = StoredTensor(shape=value.shape, parts=parts)
        flat.update({parts[part]: t.contiguous() for part, t in value.parts.items()})
    metadata = {"format": "pt", **(ckpt.to_metadata() if ckpt is not None else {})}
    metadata.update(extra_metadata or {})
    path = out_dir / WEIGHTS_FILE
    save_file(flat, str(path), metadata=metadata)
    return path
