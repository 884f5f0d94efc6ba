"""LinearFormat: what `--weight-format` selects, the format the linear layers run in, as a value.

The option is parsed once into a LinearFormat (`LinearFormat.of`, at the setup boundary and at
the loader's entry points); from there on callers ask the value what they need instead of
comparing names:

    value      quantized at load (`on_the_fly`)    packed for the CPU kernels   loads dense first
    auto       no: as the checkpoint stores         no                          no
    dense      no: dequantized at load              no                          yes
    int4       int4 g128 symmetric (RTN)            no                          no
    fp8        fp8 e4m3 128x128 blocks (RTN)        no                          no
    mxfp4      mxfp4, float activations             no                          no
    nvfp4      nvfp4, float activations             no                          no
    mxfp4a8    mxfp4, int8 activations              no                          no
    nvfp4a8    nvfp4, int8 activations              no                          no
    w4a8       no                                   w4a8                        yes
    w8a8       no                                   w8a8                        yes
    w8         no                                   w8                          yes
    blocks     no (a GGUF file's own blocks)        no                          yes

`blocks` is what `auto` resolves a GGUF file to where the C++ kernels run its block types
(densa.model.gguf_loading); users do not name it (`offered()` leaves it out of --help).

A LinearFormat is a `StrEnum`: it prints, compares and serializes as its option value, so the
CLI's choices, log lines, fingerprints and the frozen config read exactly as the strings did.
The CLI's choices stay the string tuple densa.config.WEIGHT_FORMATS (the CLI imports no torch;
this module does, through WeightFormat); tests/quant/test_linear_format.py holds it equal to
`offered()`.

HeadFormat is the same for `--head-format`, the output head's format: as loaded (dense), packed
for the CPU kernels (w8a8, w8), a GGUF file's own blocks (blocks, what `auto` resolves an untied
head to where the kernels run them), or auto (resolved per checkpoint: loader.auto_formats).
"""

from __future__ import annotations

from enum import StrEnum

from densa.config import HEAD_FROM_BLOCKS, WEIGHTS_FROM_BLOCKS
from densa.quant.weight_format import WeightFormat


class LinearFormat(StrEnum):
    AUTO = "auto"
    DENSE = "dense"
    INT4 = "int4"
    FP8 = "fp8"
    MXFP4 = "mxfp4"
    NVFP4 = "nvfp4"
    MXFP4A8 = "mxfp4a8"
    NVFP4A8 = "nvfp4a8"
    W4A8 = "w4a8"
    W8A8 = "w8a8"
    W8 = "w8"
    BLOCKS = WEIGHTS_FROM_BLOCKS

    @classmethod
    def of(cls, value: str | LinearFormat) -> LinearFormat:
        """The format an option value names (a LinearFormat is returned as it is); ValueError
        with the choices for any other."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"weight format must be one of {cls.offered()}, got {value!r}"
            ) from None

    @classmethod
    def offered(cls) -> tuple[str, ...]:
        """The values `--weight-format` offers (densa.config.WEIGHT_FORMATS, in its order)."""
        return tuple(f.value for f in cls if f is not cls.BLOCKS)

    @property
    def on_the_fly(self) -> WeightFormat | None:
        """The stored format this choice quantizes a dense checkpoint into at load time
        (round-to-nearest), and runs a quantized checkpoint of that kind as; None for the
        choices that do not quantize at load (auto, dense, the packed ones, blocks)."""
        return _ON_THE_FLY.get(self)

    @property
    def packed(self) -> str | None:
        """The CPU kernels' format (densa.model.packed_linear.PACKED) the linears are packed
        into from their dense weights after the load, or None."""
        return self.value if self in _PACKED else None

    @property
    def loads_dense_first(self) -> bool:
        """The checkpoint's own quantized layers are loaded dense: dequantized for good (dense),
        packed afterwards (w4a8, w8a8, w8), or kept in GGUF blocks where the kernels run them,
        dense otherwise (blocks)."""
        return self is LinearFormat.DENSE or self.packed is not None or self.is_gguf_blocks

    @property
    def is_auto(self) -> bool:
        """As the checkpoint stores it; resolved per checkpoint (loader.auto_formats)."""
        return self is LinearFormat.AUTO

    @property
    def is_gguf_blocks(self) -> bool:
        return self is LinearFormat.BLOCKS

    def for_draft(self) -> LinearFormat:
        """The format a draft model runs in beside a target in this one: the same packed CPU
        format (the draft shares the target's kernels), else as the draft's checkpoint says."""
        return self if self.packed is not None else LinearFormat.AUTO


# What `--weight-format int4|fp8|...` applies to a dense checkpoint at load time.
_ON_THE_FLY = {
    LinearFormat.INT4: WeightFormat("int4", group_size=128, symmetric=True),
    LinearFormat.FP8: WeightFormat("fp8", block_size=128),
    LinearFormat.MXFP4: WeightFormat("mxfp4"),
    LinearFormat.NVFP4: WeightFormat("nvfp4"),
    LinearFormat.MXFP4A8: WeightFormat("mxfp4", activations="int8"),
    LinearFormat.NVFP4A8: WeightFormat("nvfp4", activations="int8"),
}
# The packed formats users may ask for (packed_linear.PACKED_FORMATS; the others a PackedLinear
# holds come only from GGUF blocks or FP4 checkpoints).
_PACKED = (LinearFormat.W4A8, LinearFormat.W8A8, LinearFormat.W8)


class HeadFormat(StrEnum):
    AUTO = "auto"
    DENSE = "dense"
    W8A8 = "w8a8"
    W8 = "w8"
    BLOCKS = HEAD_FROM_BLOCKS

    @classmethod
    def of(cls, value: str | HeadFormat) -> HeadFormat:
        """The format an option value names; ValueError with the choices for any other."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"head format must be one of {cls.offered()}, got {value!r}") from None

    @classmethod
    def offered(cls) -> tuple[str, ...]:
        """The values `--head-format` offers (densa.config.HEAD_FORMATS, in its order)."""
        return tuple(f.value for f in cls if f is not cls.BLOCKS)

    @property
    def packed(self) -> str | None:
        """The CPU kernels' format the loaded head is packed into (a tied head gets a packed
        copy, the embedding stays), or None: the head stays as it loaded."""
        return self.value if self in (HeadFormat.W8A8, HeadFormat.W8) else None

    @property
    def is_dense(self) -> bool:
        return self is HeadFormat.DENSE

    @property
    def is_auto(self) -> bool:
        return self is HeadFormat.AUTO

    @property
    def is_gguf_blocks(self) -> bool:
        """The head keeps its GGUF blocks (swapped in when the load is planned, not packed)."""
        return self is HeadFormat.BLOCKS
