"""What a quantized weight checkpoint stores, described once and written into its metadata.

A densa weight checkpoint is a Hugging Face-style directory whose safetensors files carry one
metadata entry, `densa.weights` (JSON), so the loader reads the format instead of guessing it
from file or tensor names:

    {"version": 1,
     "format": {"kind": "int4", "group_size": 128, "symmetric": true, ...},
     "tensors": {"model.layers.0.self_attn.q_proj.weight":
                     {"shape": [576, 576], "parts": {"qweight": "...q_proj.weight.qweight", ...}}}}

Every tensor listed under "tensors" is stored as its parts (the names are data, looked up here);
every other tensor in the file is an ordinary dense tensor.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from densa.formats.fp4 import FP4_SCHEME_NAMES, Fp4Scheme

METADATA_KEY = "densa.weights"
FORMAT_VERSION = 1
# The FP4 kinds are the names of densa.formats.fp4's schemes (e2m1 codes with block scales).
WEIGHT_KINDS = ("int4", "fp8", *FP4_SCHEME_NAMES)
INT4_GROUP_SIZES = (32, 64, 128)
# float32 holds what the 16-bit dtypes cannot: a shipped checkpoint's integer zero point times
# its scale (densa.quant.shipped), exactly.
SCALE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
METHODS = ("rtn", "gptq")


@dataclass(frozen=True)
class WeightFormat:
    """How every quantized linear weight of one checkpoint is stored."""

    # "int4" (weight-only, group-wise), "fp8" (e4m3 with block scales), "mxfp4" (e2m1, an E8M0
    # scale per 32 inputs) or "nvfp4" (e2m1, an e4m3 scale per 16 and a float32 per tensor).
    # The name as stored in the metadata; an FP4 kind is asked through its scheme (`fp4`).
    kind: str
    group_size: int = 128  # int4: input columns sharing one scale (and offset)
    symmetric: bool = True  # int4: w = (q - 8) * s; asymmetric adds a per-group offset z
    scale_dtype: str = "bfloat16"  # int4 scales/offsets; torch's CPU int4 matmul wants bf16
    block_size: int = 128  # fp8: square blocks of block_size x block_size share one fp32 scale
    method: str = "rtn"  # how the values were chosen: round-to-nearest, or GPTQ on calibration
    # FP4 on the CPU kernels: activations rounded to int8 per 32 inputs ("int8": the VNNI
    # kernels, what `--weight-format auto` runs) or as given ("float": weight-only, with
    # `--weight-format mxfp4|nvfp4`). How the weights run, not how they are stored (stored
    # formats say "float").
    activations: str = "float"

    def __post_init__(self) -> None:
        if self.kind not in WEIGHT_KINDS:
            raise ValueError(f"weight kind must be one of {WEIGHT_KINDS}, got {self.kind!r}")
        if self.kind == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale dtype must be one of {tuple(SCALE_DTYPES)}")
        if self.block_size < 1:
            raise ValueError("fp8 block size must be >= 1")
        if self.activations not in ("float", "int8"):
            raise ValueError(f"activations must be float or int8, got {self.activations!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if (self.kind == "fp8" or self.is_fp4) and self.method != "rtn":
            raise ValueError(
                f"{self.kind} weights are quantized by round-to-nearest only (--method rtn)"
            )

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return SCALE_DTYPES[self.scale_dtype]

    def stored_as(self) -> WeightFormat:
        """The format with the run-time choices reset: what the stored parts are."""
        return replace(self, activations="float")

    @property
    def fp4(self) -> Fp4Scheme | None:
        """The FP4 scheme the kind names (what differs between MXFP4 and NVFP4), else None."""
        return Fp4Scheme.named(self.kind)

    @property
    def is_fp4(self) -> bool:
        return self.fp4 is not None

    def describe(self) -> str:
        """'int4 g128 sym (gptq)' / 'fp8 e4m3 128x128 blocks': for logs and reports."""
        if self.fp4 is not None:
            return self.fp4.describe(", int8 activations" if self.activations == "int8" else "")
        if self.kind == "fp8":
            return f"fp8 e4m3 {self.block_size}x{self.block_size} blocks"
        symmetry = "sym" if self.symmetric else "asym"
        return f"int4 g{self.group_size} {symmetry} {self.scale_dtype} ({self.method})"


@dataclass
class StoredTensor:
    """One quantized tensor in a checkpoint: its logical shape ([out, in], or [experts, out, in]
    for stacked experts) and where its parts are."""

    shape: tuple[int, ...]
    parts: dict[str, str]  # part name ("qweight", "scales", ...) -> tensor name in the file


@dataclass
class CheckpointFormat:
    """The `densa.weights` metadata of a checkpoint."""

    format: WeightFormat
    tensors: dict[str, StoredTensor] = field(default_factory=dict)  # logical name -> parts
    # Who wrote the parts: "densa" (its own layout), or a producer whose layout
    # densa.quant.shipped converts into `format` as each weight is read.
    producer: str = "densa"
    # Weights stored quantized that no densa layout holds exactly (act-order groups): they are
    # dequantized when loaded instead.
    dense: frozenset[str] = frozenset()

    def to_metadata(self) -> dict[str, str]:
        payload = {
            "version": FORMAT_VERSION,
            "format": asdict(self.format),
            "tensors": {
                name: {"shape": list(t.shape), "parts": t.parts} for name, t in self.tensors.items()
            },
        }
        return {METADATA_KEY: json.dumps(payload)}

    @classmethod
    def from_metadata(cls, metadata: dict[str, str] | None) -> CheckpointFormat | None:
        """The stored format, or None for a plain dense checkpoint (no `densa.weights` entry)."""
        if not metadata or METADATA_KEY not in metadata:
            return None
        payload: dict[str, Any] = json.loads(metadata[METADATA_KEY])
        if payload.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"weight format version {payload.get('version')} is not supported "
                f"(this densa reads version {FORMAT_VERSION}); re-run densa quantize"
            )
        tensors = {
            name: StoredTensor(shape=tuple(int(d) for d in t["shape"]), parts=t["parts"])
            for name, t in payload["tensors"].items()
        }
        return cls(format=WeightFormat(**payload["format"]), tensors=tensors)

    def merge(self, other: CheckpointFormat) -> None:
        """Fold in another shard's metadata (sharded checkpoints list each tensor once)."""
        if other.format != self.format:
            raise ValueError("checkpoint shards disagree on the weight format")
        self.tensors.update(other.tensors)


def part_name(tensor_name: str, part: str) -> str:
    """Where a part of a quantized tensor is stored: '<tensor name>.<part>'."""
    return f"{tensor_name}.{part}"
