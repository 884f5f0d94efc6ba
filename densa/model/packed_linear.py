"""Linear layers in the CPU kernels' packed formats: W4A8, W5A8, W5MA8, W6A8, W6MA8, W8A8 and the
FP4 formats MXFP4 and NVFP4, groups of 32 (kernels/cpu/qgemm.py).

    w4a8   4-bit weights, fp16 scale and minimum per 32 inputs (llama.cpp's Q4_1 arithmetic);
           activations quantized to int8 per token and 32 inputs at every call (its Q8_1)
    w8a8   8-bit weights, fp16 scale per 32 inputs (Q8_0); activations as above
    w8     the same 8-bit weights with float32 activations (weight-only): the product with the
           stored weights, no activation rounding; more arithmetic than w8a8, so meant for the
           output head at decode (--head-format w8)
    w6a8   6-bit weights, fp16 scale per 32 and int8 scale per 16 inputs: a GGUF file's Q6_K
           blocks (Q5_0 and Q4_0 fit too) run from their exact values. Not a --weight-format:
           loaders make it from GGUF blocks (qgemm.quantize_w6 from dense weights, for tests)
    w6ma8  w6a8 plus an fp16 minimum per 32 inputs: GGUF's Q5_1 (exactly) and Q5_K (its
           minimums rounded to fp16). Not a --weight-format either
    w5a8   w6a8 with 5-bit codes (6.0 bits per weight against 7.0): GGUF's Q5_0, Q3_K (and
           Q4_0) exactly. From GGUF blocks only, as w6a8
    w5ma8  w6ma8 with 5-bit codes, unsigned (6.5 bits per weight against 7.5): Q5_1 exactly,
           Q5_K (its minimums rounded to fp16). From GGUF blocks only
    mxfp4  e2m1 codes with an E8M0 scale per 32 inputs (densa.formats.fp4), float32
           activations (weight-only: the product with the stored weights), made from MXFP4
           weights as checkpoints ship them (Fp4Linear.packed); 4.25 bits per weight
    nvfp4  e2m1 codes with an e4m3 scale per 16 inputs and a float32 per row (its tensor's
           scale), float32 activations; 4.5 bits
    mxfp4a8, nvfp4a8  the same blocks with int8 activations per 32 inputs (the VNNI kernels;
           llama.cpp's MXFP4 x Q8 arithmetic; what `auto` runs an FP4 checkpoint on). None is
           a --weight-format of this table:
           `--weight-format mxfp4|nvfp4[a8]` selects or makes FP4 weights (runtime_weights)

The w4a8 / w8a8 / w8 layers are made at load time from dense weights. Weights that came from a
GGUF file's Q4_1 / Q8_0 blocks (the bundled model) come back as the very same codes and scales
(quantize_q4_1 below, tests/model/test_packed_linear.py), so densa then computes with llama.cpp's
bits.

A fused layer whose parts come in different formats (a GGUF q|k|v with q, k in Q4_K and v in
Q6_K) is a `ShardedPackedLinear`: its shards' outputs side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from densa.formats import fp4
from densa.kernels.cpu import native, qgemm


class PackedFormatUnavailable(RuntimeError):
    """The packed formats need densa's C++ kernels, which could not be built on this machine."""


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] dense -> W4 codes (0..15), d and m per group of 32, as llama.cpp's Q4_1 makes them:
    m = the group's minimum, d = (max - min) / 15, both rounded to fp16 first."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // qgemm.GROUP, qgemm.GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    m = low.half().float()
    d = ((high - low) / 15.0).half().float()
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    codes = torch.round((groups - m[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    return codes.view(rows, cols), d, m


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fp4.quantize_mxfp4(weight)


def quantize_nvfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dense [N, K] weight -> NVFP4 codes, e4m3 block scales and the tensor scale per row."""
    qweight, scales, t = fp4.quantize_nvfp4(weight)
    return qweight, scales, t.expand(weight.shape[0]).contiguous()


@dataclass(frozen=True)
class PackedFormat:
    """One packed weight format and its kernels: how dense weights become its codes and scales
    ("parts"), how parts become the kernels' blocks, and the torch references of both."""

    name: str
    bits: int  # the kernels' code for the format (csrc/qgemm.h)
    block_bytes: int  # one block per 16 rows x 32 inputs (csrc/qgemm.h: kW4Block, kW8Block ...)
    offered: bool  # a --weight-format choice; the w5 / w6 formats come only from GGUF blocks
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]  # dense [N, K] -> parts
    pack: Callable[..., qgemm.PackedWeight]  # (*parts, isa) -> blocks for this machine
    reference: Callable[..., torch.Tensor]  # (x, *parts) -> what the kernel computes, float64
    dequantize: Callable[..., torch.Tensor]  # (*parts) -> the stored weight, float32 [N, K]
    row_trailer_bytes: int = 0  # after the blocks, per output row (NVFP4: its float32 scale)


_W8 = (qgemm.quantize_w8, qgemm.pack_w8, qgemm.w8a8_reference, qgemm.dequantize_w8)
_W8_FLOAT = (qgemm.quantize_w8, qgemm.pack_w8_float, qgemm.w8_float_reference, qgemm.dequantize_w8)
_W6 = (qgemm.quantize_w6, qgemm.pack_w6, qgemm.w6a8_reference, qgemm.dequantize_w6)
_W6M = (qgemm.quantize_w6m, qgemm.pack_w6m, qgemm.w6ma8_reference, qgemm.dequantize_w6m)
_W5 = (qgemm.quantize_w5, qgemm.pack_w5, qgemm.w6a8_reference, qgemm.dequantize_w6)
_W5M = (qgemm.quantize_w5m, qgemm.pack_w5m, qgemm.w6ma8_reference, qgemm.dequantize_w6m)
_W4 = (quantize_q4_1, qgemm.pack_w4, qgemm.w4a8_reference, qgemm.dequantize_w4)
_MXFP4A8 = (quantize_mxfp4, qgemm.pack_mxfp4, qgemm.mxfp4a8_reference, fp4.dequantize_mxfp4)
_NVFP4A8 = (quantize_nvfp4, qgemm.pack_nvfp4, qgemm.nvfp4a8_reference, fp4.dequantize_nvfp4)
_MXFP4 = (quantize_mxfp4, qgemm.pack_mxfp4_float, qgemm.mxfp4_float_reference,
          fp4.dequantize_mxfp4)  # fmt: skip
_TENSOR_SCALE = 4  # bytes: NVFP4's float32 tensor scale, one per row after the blocks
_NVFP4 = (quantize_nvfp4, qgemm.pack_nvfp4_float, qgemm.nvfp4_float_reference,
          fp4.dequantize_nvfp4)  # fmt: skip
PACKED = {
    f.name: f
    for f in (
        PackedFormat("w4a8", 4, 320, True, *_W4),
        PackedFormat("w8a8", 8, 544, True, *_W8),
        PackedFormat("w8", qgemm.W8_FLOAT, 544, True, *_W8_FLOAT),
        PackedFormat("w6a8", 6, 448, False, *_W6),
        PackedFormat("w6ma8", qgemm.W6_MIN, 480, False, *_W6M),
        PackedFormat("w5a8", 5, 384, False, *_W5),
        PackedFormat("w5ma8", qgemm.W5_MIN, 416, False, *_W5M),
        PackedFormat("mxfp4", qgemm.MXFP4, 272, False, *_MXFP4),
        PackedFormat("nvfp4", qgemm.NVFP4, 288, False, *_NVFP4, _TENSOR_SCALE),
        PackedFormat("mxfp4a8", qgemm.MXFP4A8, 272, False, *_MXFP4A8),
        PackedFormat("nvfp4a8", qgemm.NVFP4A8, 288, False, *_NVFP4A8, _TENSOR_SCALE),
    )
}
PACKED_FORMATS = tuple(name for name, f in PACKED.items() if f.offered)  # --weight-format's
KERNEL_FORMATS = tuple(PACKED)  # every format a PackedLinear can hold


def packed_format(fmt: str) -> PackedFormat:
    if fmt not in PACKED:
        raise ValueError(f"unknown packed format {fmt!r}; choose from {KERNEL_FORMATS}")
    return PACKED[fmt]


class PackedLinear(nn.Module):
    """y = x W^T (+ b) with W in a packed format; x in any float dtype, y in x's dtype."""

    blocks: torch.Tensor

    def __init__(
        self, fmt: str, weight: torch.Tensor | qgemm.PackedWeight, bias: torch.Tensor | None
    ) -> None:
        """`weight`: dense [out, in] (packed here), or already packed for this machine's isa."""
        super().__init__()
        isa = kernel_isa(fmt)
        self.fmt, self.isa = fmt, isa
        if isinstance(weight, torch.Tensor):
            weight = _pack(fmt, weight.detach(), isa)
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.register_buffer("blocks", weight.blocks)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), False)

    @classmethod
    def empty(cls, fmt: str, in_features: int, out_features: int, bias: bool) -> PackedLinear:
        """Uninitialized blocks (allocated on the current default device: meta while a model is
        built) for a loader that writes the packed bytes itself (densa.model.gguf_loading)."""
        blocks = torch.empty(packed_bytes(fmt, out_features, in_features), dtype=torch.uint8)
        bits = packed_format(fmt).bits
        packed = qgemm.PackedWeight(blocks, out_features, in_features, bits, kernel_isa(fmt))
        return cls(fmt, packed, torch.empty(out_features) if bias else None)

    @property
    def bits(self) -> int:
        """The kernels' code for this format (csrc/qgemm.h)."""
        return packed_format(self.fmt).bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = qgemm.PackedWeight(
            self.blocks, self.out_features, self.in_features, self.bits, self.isa
        )
        out = qgemm.quantized_linear(x.reshape(-1, self.in_features), weight).to(x.dtype)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.fmt} ({self.isa})"
        )


class ShardedPackedLinear(nn.Module):
    """y = x W^T (+ b) with W's output rows in shards, each a PackedLinear of its own format,
    their outputs side by side: a fused q|k|v whose v has more bits than q and k keeps each
    part's exact values. The fused decode step writes each shard into its columns in place."""

    def __init__(self, shards: Sequence[PackedLinear], bias: torch.Tensor | None) -> None:
        """`shards`: bias-free, all of the same in_features; `bias`: [sum of their outputs]."""
        super().__init__()
        if not shards or any(s.bias is not None for s in shards):
            raise ValueError("a sharded linear needs one or more shards without biases")
        if len({s.in_features for s in shards}) != 1:
            raise ValueError("the shards of a linear layer read the same inputs")
        self.shards = nn.ModuleList(shards)
        self.in_features = shards[0].in_features
        self.out_features = sum(s.out_features for s in shards)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), False)

    @classmethod
    def empty(
        cls, fmts: Sequence[str], in_features: int, outs: Sequence[int], bias: bool
    ) -> ShardedPackedLinear:
        """Uninitialized shards of these formats and output sizes (see PackedLinear.empty)."""
        shards = [
            PackedLinear.empty(fmt, in_features, out, False)
            for fmt, out in zip(fmts, outs, strict=True)
        ]
        return cls(shards, torch.empty(sum(outs)) if bias else None)

    @property
    def packed_shards(self) -> list[PackedLinear]:
        return cast(list[PackedLinear], list(self.shards))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([shard(x) for shard in self.shards], dim=-1)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        formats = "|".join(s.fmt for s in self.packed_shards)
        return f"in_features={self.in_features}, out_features={self.out_features}, format={formats}"


def kernel_isa(fmt: str) -> str:
    """The code path the kernels run here; refuses when they are not built."""
    isa = native.isa() if native.load() is not None else ""
    if not isa:
        raise PackedFormatUnavailable(
            f"--weight-format {fmt} runs on densa's C++ CPU kernels, which are not built "
            "here (they need a C++ compiler and an x86 CPU with AVX2); use dense weights"
        )
    return isa


def packed_bytes(fmt: str, out_features: int, in_features: int) -> int:
    """Bytes of a [out, in] weight in a packed format: one block per 16 rows x 32 inputs (and
    NVFP4's float32 tensor scale per row after them)."""
    blocks = (out_features // qgemm.PANEL) * (in_features // qgemm.GROUP)
    packed = packed_format(fmt)
    return blocks * packed.block_bytes + packed.row_trailer_bytes * out_features


def _pack(fmt: str, weight: torch.Tensor, isa: str) -> qgemm.PackedWeight:
    packed = packed_format(fmt)
    return packed.pack(*packed.quantize(weight), isa)


def can_pack(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and qgemm.fits(weight.shape[1], weight.shape[0])
    )


def pack_linears(model: nn.Module, names: set[str], fmt: str) -> list[str]:
    """Replace the named (loaded, dense) linear modules by packed ones; returns the names left
    dense because their shape does not tile (K % 32, N % 16)."""
    skipped = []
    for name in sorted(names):
        dense = model.get_submodule(name)
        if not can_pack(dense):
            skipped.append(name)
            continue
        weight, bias = getattr(dense, "weight"), getattr(dense, "bias", None)  # noqa: B009
        model.set_submodule(name, PackedLinear(fmt, weight, bias))
    return skipped


def reference_linear(x: torch.Tensor, weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """What a PackedLinear of `weight` computes, in float64 (tests)."""
    packed = packed_format(fmt)
    return packed.reference(x, *packed.quantize(weight))


def dequantized_weight(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """The weight a packed format stores, as float32 (quality analyses: weights-only error)."""
    packed = packed_format(fmt)
    return packed.dequantize(*packed.quantize(weight))
