"""Resident weight bytes and how each GGUF tensor type executes, per file, under the default
`--weight-format auto --head-format auto` (the memory check's plan: a meta model from the
header, no tensor read; it equals what `load_model` then holds, see densa/setup/memory_plan.py).

    python docs/eval/gguf_types_1.5b/resident.py FILE.gguf [...]
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch

from densa.model.arch import ArchConfig
from densa.model.gguf import GGUFFile, ensure_converted
from densa.model.loader import DTYPES, auto_formats, kept_embedding, kept_linears
from densa.model.registry import meta_skeleton, model_factory
from densa.setup.memory_plan import plan_weights

CPU = torch.device("cpu")
MAX_LEN = 1024


def describe(path: Path) -> None:
    model_dir = ensure_converted(path)
    arch = ArchConfig.from_dir(model_dir)
    weights, head = auto_formats(str(path), model_dir, "auto", "auto")
    plan = plan_weights(model_dir, arch, "float32", MAX_LEN, CPU, weights, head)
    source = GGUFFile.of_converted(model_dir)
    assert source is not None
    with meta_skeleton():
        model = model_factory(arch.architecture)(arch, MAX_LEN, CPU).to(DTYPES["float32"])
        kept = kept_linears(model, source, weights, head, CPU)
        table = kept_embedding(model, source, arch, CPU)
    shard_types: dict[str, list[str]] = {}
    for name, (type_name, _) in source.layouts().items():
        module, _, param = model.checkpoint_target(name).rpartition(".")
        if module in kept and param == "weight":
            shard_types.setdefault(module, []).append(type_name)
    layers = Counter(
        (module.rsplit(".", 1)[-1], "+".join(shard_types[module]), layer.fmt, layer.exact)
        for module, layer in kept.items()
    )
    size = path.stat().st_size
    print(
        f"{path.name}: file {size:,} B, resident {plan.resident_bytes:,} B "
        f"({plan.resident_bytes / size:.3f}x), embedding {table.type_name if table else 'dense'}"
    )
    for (layer, types, fmt, exact), count in sorted(layers.items()):
        rounding = "exact" if exact else "fp16 scales"
        print(f"    {count:3d} {layer:14s} {types:16s} -> {fmt:12s} {rounding}")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        describe(Path(arg))
