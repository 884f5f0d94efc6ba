"""Linear layers in the CPU kernels' packed formats: W4A8, W6A8, W6MA8 and W8A8, groups of 32
(kernels/qgemm.py).

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

The w4a8 / w8a8 / w8 layers are made at load time from dense weights. Weights that came from a
GGUF file's Q4_1 / Q8_0 blocks (the bundled model) come back as the very same codes and scales
(quantize_q4_1 below, tests/model/test_packed_linear.py), so densa then computes with llama.cpp's
bits.

A fused layer whose parts come in different formats (a GGUF q|k|v with q, k in Q4_K and v in
Q6_K) is a `ShardedPackedLinear`: its shards' outputs side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from densa.kernels import native, qgemm

PACKED_FORMATS = ("w4a8", "w8a8", "w8")  # the ones --weight-format offers
KERNEL_FORMATS = (*PACKED_FORMATS, "w6a8", "w6ma8")  # every format a PackedLinear can hold
_BITS = {"w4a8": 4, "w6a8": 6, "w6ma8": qgemm.W6_MIN, "w8a8": 8, "w8": qgemm.W8_FLOAT}
# csrc/qgemm.h: kW4Block, kW6Block, kW6MBlock, kW8Block
_BLOCK_BYTES = {"w4a8": 320, "w6a8": 448, "w6ma8": 480, "w8a8": 544, "w8": 544}


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
        packed = qgemm.PackedWeight(blocks, out_features, in_features, _BITS[fmt], kernel_isa(fmt))
        return cls(fmt, packed, torch.empty(out_features) if bias else None)

    @property
    def bits(self) -> int:
        """The kernels' code for this format (csrc/qgemm.h)."""
        return _BITS[self.fmt]

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
    """Bytes of a [out, in] weight in a packed format: one block per 16 rows x 32 inputs."""
    return (out_features // qgemm.PANEL) * (in_features // qgemm.GROUP) * _BLOCK_BYTES[fmt]


def _pack(fmt: str, weight: torch.Tensor, isa: str) -> qgemm.PackedWeight:
    if fmt == "w4a8":
        return qgemm.pack_w4(*quantize_q4_1(weight), isa)
    if fmt == "w8a8":
        return qgemm.pack_w8(*qgemm.quantize_w8(weight), isa)
    if fmt == "w8":
        return qgemm.pack_w8_float(*qgemm.quantize_w8(weight), isa)
    if fmt == "w6a8":
        return qgemm.pack_w6(*qgemm.quantize_w6(weight), isa)
    if fmt == "w6ma8":
        return qgemm.pack_w6m(*qgemm.quantize_w6m(weight), isa)
    raise ValueError(f"unknown packed format {fmt!r}; choose from {KERNEL_FORMATS}")


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
    if fmt == "w4a8":
        return qgemm.w4a8_reference(x, *quantize_q4_1(weight))
    if fmt == "w8":
        return qgemm.w8_float_reference(x, *qgemm.quantize_w8(weight))
    if fmt == "w6a8":
        return qgemm.w6a8_reference(x, *qgemm.quantize_w6(weight))
    if fmt == "w6ma8":
        return qgemm.w6ma8_reference(x, *qgemm.quantize_w6m(weight))
    return qgemm.w8a8_reference(x, *qgemm.quantize_w8(weight))


def dequantized_weight(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """The weight a packed format stores, as float32 (quality analyses: weights-only error)."""
    if fmt == "w4a8":
        return qgemm.dequantize_w4(*quantize_q4_1(weight))
    if fmt == "w6a8":
        return qgemm.dequantize_w6(*qgemm.quantize_w6(weight))
    if fmt == "w6ma8":
        return qgemm.dequantize_w6m(*qgemm.quantize_w6m(weight))
    return qgemm.dequantize_w8(*qgemm.quantize_w8(weight))
