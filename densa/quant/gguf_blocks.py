"""GGUF block types in the CPU kernels' terms, per group of 32 inputs (densa.kernels.cpu.qgemm):

    w4   w = d q + m          q in 0..15      (the w4a8 kernel; d, m stored as fp16)
    w5   w = d sc[h] q        q in -16..15    (the w5a8 kernel; d fp16 per group, sc int8 per
                                                half-group h of 16 inputs: d sc is exact)
    w5m  w = d sc[h] q + m    q in 0..31      (the w5ma8 kernel: w5 plus an fp16 minimum)
    w6   w = d sc[h] q        q in -32..31    (the w6a8 kernel: w5 with 6-bit codes)
    w6m  w = d sc[h] q + m    q in -32..31    (the w6ma8 kernel: w6 plus an fp16 minimum)
    w8   w = d q              q in -128..127  (the w8a8 / w8 kernels; d stored as fp16)

How each GGUF type maps (llama.cpp's ggml-quants.c block layouts; x = one 32-weight group):

    type    block (bytes / weights)            weight                kernel terms          exact
    Q4_0    d16 | 16 B nibbles       (18/32)   d (q - 8)             w4: m = -8 d          yes
                                                                     w5, w6: q - 8, sc = 1 yes
                                                                     w8: q - 8             yes
    Q4_1    d16 m16 | 16 B nibbles   (20/32)   d q + m               w4                    yes
    Q5_0    d16 | qh32 | 16 B nibbles (22/32)  d (q - 16), q 5 bits  w5, w6: q - 16,       yes
                                                                     sc = 1
                                                                     w8: q - 16            yes
    Q5_1    d16 m16 | qh32 | 16 B nibbles      d q + m, q 5 bits     w5m, w6m: q, sc = 1   yes
                                     (24/32)
    Q8_0    d16 | 32 x int8          (34/32)   d q                   w8                    yes
    Q3_K    32 B hmask | 64 B 2-bit pairs | 12 B 6-bit scales | d16   (110/256)
                                               d (s - 32) q3,        w5, w6: q3, sc =      yes
                                               q3 in -4..3 (16       s - 32, d per group =
                                               sub-blocks of 16)     the block's d
    Q4_K    d16 dmin16 | 12 B 6-bit scales and mins | 128 B nibbles   (144/256)
                                               d sc q - dmin mn      w4: d' = d sc,        no: d'
                                               (8 sub-blocks of 32)      m' = -dmin mn     and m'
                                                                                           fp16
    Q5_K    d16 dmin16 | 12 B scales and mins | 32 B high bits | 128 B nibbles   (176/256)
                                               d sc q - dmin mn,     w5m, w6m: q, sc = sc  no: m'
                                               q 5 bits (8 sub-      in both halves, d =   fp16
                                               blocks of 32)         the block's d, m' =
                                                                     -dmin mn
    Q6_K    128 B low nibbles | 64 B high 2-bit pairs | 16 x int8 sc | d16   (210/256)
                                               d sc (q - 32), q 6    w6: d per group =     yes
                                               bits (16 sub-blocks   the block's d
                                               of 16)
    IQ4_NL  d16 | 16 B nibbles       (18/32)   d T[q], T = llama.cpp's w8: codes T[q]      yes
                                               kvalues_iq4nl (16 int8 values)
    IQ4_XS  d16 | 2 B high scale bits | 4 B low scale nibbles | 128 B nibbles   (136/256)
                                               d (ls - 32) T[q]      w8: d' = d (ls - 32), no: d'
                                               (8 sub-blocks of 32)      codes T[q]        fp16

d sc with a 6-bit sc needs up to 17 significant bits, and so does dmin mn; an fp16 field keeps
11, so where such a product is stored as a block's d or m (Q4_K's d' and m', Q5_K's m',
IQ4_XS's d') the repack rounds it once per group (relative error <= 2^-11; measured in
tests/model/test_gguf_quants.py). w5 and w6 keep d and sc apart, so their product is exact.
Everything here is float32, as exact as the products are: the rounding to fp16 happens where the
kernels pack (qgemm.pack_w4 / pack_w5 / pack_w5m / pack_w6 / pack_w6m / pack_w8). The w5
families take the same decoders as w6 (their codes fit 5 bits): a 5-bit type keeps 6.0 or 6.5
bits a weight in memory instead of 7.0 or 7.5.

Not mapped (their tensors are dequantized to float32, and the loader warns naming the type and
what it costs): Q2_K (a scale and a minimum per 16 inputs: no family has a minimum per half
group), the other IQ* types (codebook grids), TQ*, MXFP4.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

GROUP = 32
HALF = 16  # inputs per w5 / w6 sub-scale (Q6_K's sub-blocks)
QK_K = 256  # elements of a K-quant super-block


@dataclass(frozen=True)
class KernelGroups:
    """A [rows, cols] weight as kernel codes with one scale (and minimum) per group of 32."""

    codes: np.ndarray  # [rows, cols]: uint8 0..15 (w4) or int8 (w5: -16..15, w5m: 0..31, w6,
    # w6m: -32..31; w8)
    d: np.ndarray  # [rows, cols / 32] float32
    m: np.ndarray | None  # [rows, cols / 32] float32 (w4, w5m, w6m)
    sc: np.ndarray | None = None  # [rows, cols / 16] int8 (w5, w5m, w6, w6m)

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols], computed as llama.cpp's dequantize does (d sc first, then
        times the code: the same roundings)."""
        rows, cols = self.codes.shape
        shape = (rows, cols // GROUP, GROUP)
        if self.sc is not None:  # w5, w5m, w6, w6m: per half-group of 16
            halves = (rows, cols // HALF, HALF)
            scale = np.repeat(self.d, 2, axis=1) * self.sc.astype(np.float32)
            values = scale[..., None] * self.codes.reshape(halves).astype(np.float32)
        else:
            values = self.d[..., None] * self.codes.reshape(shape).astype(np.float32)
        if self.m is not None:
            values = values.reshape(shape) + self.m[..., None]
        return values.reshape(rows, cols)


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float32 (fp16 little-endian)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: element j is byte j's low nibble, j + 16 its high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _blocks(raw: np.ndarray, cols: int, block_len: int, block_bytes: int) -> np.ndarray:
    rows = raw.shape[0]
    return np.asarray(raw, dtype=np.uint8).reshape(rows, cols // block_len, block_bytes)


def _q4_0_w4(raw: np.ndarray, cols: int) -> KernelGroups:
    blocks = _blocks(raw, cols, GROUP, 18)
    d = _f16(blocks[..., 0:2])
    codes = _nibbles(blocks[..., 2:]).reshape(raw.shape[0], cols)
    return KernelGroups(codes, d, np.float32(-8.0) * d)


def _q4_0_w8(raw: np.ndarray, cols: int) -> KernelGroups:
    w4 = _q4_0_w4(raw, cols)
    return KernelGroups((w4.codes.astype(np.int16) - 8).astype(np.int8), w4.d, None)


def _q4_1_w4(raw: np.ndarray, cols: int) -> KernelGroups:
    blocks = _blocks(raw, cols, GROUP, 20)
    codes = _nibbles(blocks[..., 4:]).reshape(raw.shape[0], cols)
    return KernelGroups(codes, _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]))


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 codes 0..31 [..., 32]: 4 B of high bits (bit i: element i) and 16 B nibbles."""
    bits = np.ascontiguousarray(qh).view("<u4")  # [..., 1]
    high = ((bits >> np.arange(GROUP, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    return _nibbles(qs) | high


def _q5_0_w8(raw: np.ndarray, cols: int) -> KernelGroups:
    blocks = _blocks(raw, cols, GROUP, 22)
    codes = (_five_bits(blocks[..., 2:6], blocks[..., 6:]).astype(np.int16) - 16).astype(np.int8)
    return KernelGroups(codes.reshape(raw.shape[0], cols), _f16(blocks[..., 0:2]), None)


def _q5_1_split(raw: np.ndarray, cols: int) -> KernelGroups:
    """w = d q + m: codes q (0..31; w6m stores u = q + 32, w5m q itself), unit sub-scales."""
    blocks = _blocks(raw, cols, GROUP, 24)
    codes = _five_bits(blocks[..., 4:8], blocks[..., 8:]).astype(np.int8)
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc = np.ones((d.shape[0], d.shape[1] * 2), dtype=np.int8)
    return KernelGroups(codes.reshape(raw.shape[0], cols), d, m, sc)


def _unit_split(groups: KernelGroups) -> KernelGroups:
    """A w8-family decode whose codes fit 5 bits as w5 / w6 with unit sub-scales."""
    sc = np.ones((groups.d.shape[0], groups.d.shape[1] * 2), dtype=np.int8)
    return KernelGroups(groups.codes, groups.d, None, sc)


def _q4_0_split(raw: np.ndarray, cols: int) -> KernelGroups:
    return _unit_split(_q4_0_w8(raw, cols))


def _q5_0_split(raw: np.ndarray, cols: int) -> KernelGroups:
    return _unit_split(_q5_0_w8(raw, cols))


def _q6_k_w6(raw: np.ndarray, cols: int) -> KernelGroups:
    """Q6_K (llama.cpp's dequantize_row_q6_K): each 128-element half of a super-block takes 64
    bytes of low nibbles and 32 of high bit pairs; element 32 j + l of the half (j = 0..3) is
    ql[l + 32 (j % 2)] >> 4 (j // 2) | ((qh[l] >> 2 j) & 3) << 4, minus 32."""
    rows = raw.shape[0]
    blocks = _blocks(raw, cols, QK_K, 210)
    ql = blocks[..., 0:128].reshape(rows, -1, 2, 2, 32)  # [r, s, half, j % 2, l]
    qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)  # [r, s, half, -, l]
    low = np.stack([ql & 0x0F, ql >> 4], axis=3)  # [r, s, half, j // 2, j % 2, l]
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(2, 2, 1)  # j = 2 (j // 2) + j % 2
    high = ((qh[:, :, :, None] >> shifts) & 3) << 4  # [r, s, half, j // 2, j % 2, l]
    codes = ((low | high).astype(np.int16) - 32).astype(np.int8)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(rows, -1)
    d = np.repeat(_f16(blocks[..., 208:210]), QK_K // GROUP, axis=1)
    return KernelGroups(codes.reshape(rows, cols), d, None, sc)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """[..., 12] bytes -> the 16 sub-blocks' 6-bit scales minus 32 [..., 16] int8: scale j's
    low nibble is byte j % 8's (low for j < 8, high after), its top 2 bits byte 8 + j % 4's
    bits 2 (j // 4)."""
    low = np.concatenate([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], axis=-1)
    shifts = (2 * np.arange(4, dtype=np.uint8))[:, None]  # [j // 4, j % 4]
    high = ((packed[..., None, 8:12] >> shifts) & 3).reshape(*packed.shape[:-1], 16)
    return ((low | high << 4).astype(np.int16) - 32).astype(np.int8)


def _q3_k_split(raw: np.ndarray, cols: int) -> KernelGroups:
    """Q3_K (llama.cpp's dequantize_row_q3_K): element 128 c + 32 j + l of a super-block
    (c = 0, 1; j = 0..3) takes bits 2 j of qs[32 c + l] and bit 4 c + j of hmask[l]; its code
    is those 2 bits, less 4 where the hmask bit is 0."""
    rows = raw.shape[0]
    blocks = _blocks(raw, cols, QK_K, 110)
    qs = blocks[..., 32:96].reshape(rows, -1, 2, 1, 32)  # [r, s, c, -, l]
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    low = (qs >> shifts) & 3  # [r, s, c, j, l]
    hmask = blocks[..., 0:32].reshape(rows, -1, 1, 32)
    high = ((hmask >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1).reshape(low.shape)
    codes = low.astype(np.int8) - 4 * (1 - high.astype(np.int8))
    sc = _q3_k_scales(blocks[..., 96:108]).reshape(rows, -1)
    d = np.repeat(_f16(blocks[..., 108:110]), QK_K // GROUP, axis=1)
    return KernelGroups(codes.reshape(rows, cols), d, None, sc)


def _q8_0_w8(raw: np.ndarray, cols: int) -> KernelGroups:
    blocks = _blocks(raw, cols, GROUP, 34)
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(raw.shape[0], cols)
    return KernelGroups(codes, _f16(blocks[..., 0:2]), None)


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] bytes -> 6-bit scales and mins [..., 8] (llama.cpp's get_scale_min_k4)."""
    low, mid, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 0x3F, (high >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k_w4(raw: np.ndarray, cols: int) -> KernelGroups:
    rows = raw.shape[0]
    blocks = _blocks(raw, cols, QK_K, 144)
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [rows, supers]
    sc, mn = _q4_k_scales(blocks[..., 4:16])  # [rows, supers, 8]
    # 128 code bytes = 4 chunks of 32: chunk c holds sub-block 2c (low nibbles), 2c + 1 (high).
    qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)
    codes = (qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F  # [r, s, 4, 2, 32]
    scale = (d[..., None] * sc).reshape(rows, -1)  # exact in float32: 11 x 6 bits
    minimum = (-(dmin[..., None] * mn)).reshape(rows, -1)
    return KernelGroups(codes.reshape(rows, cols), scale, minimum)


def _q5_k_split(raw: np.ndarray, cols: int) -> KernelGroups:
    """Q5_K: Q4_K's scales, mins and nibble order, plus bit j of high-bit byte l as bit 4 of
    sub-block j's element l; each sub-block's 6-bit scale is the sc of both its halves."""
    rows = raw.shape[0]
    blocks = _blocks(raw, cols, QK_K, 176)
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [rows, supers]
    sc, mn = _q4_k_scales(blocks[..., 4:16])  # [rows, supers, 8]
    qh = blocks[..., 16:48].reshape(rows, -1, 1, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # [r, s, sub-block, l]
    qs = blocks[..., 48:].reshape(rows, -1, 4, 1, 32)
    low = (qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F  # [r, s, 4, 2, 32]
    codes = (low.reshape(high.shape) | high << 4).astype(np.int8)
    halves = np.repeat(sc.astype(np.int8).reshape(rows, -1), 2, axis=1)
    minimum = (-(dmin[..., None] * mn)).reshape(rows, -1)  # 11 x 6 bits: rounded when packed
    groups_d = np.repeat(d, QK_K // GROUP, axis=1)
    return KernelGroups(codes.reshape(rows, cols), groups_d, minimum, halves)


# llama.cpp's kvalues_iq4nl: the 16 values an IQ4 nibble indexes.
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      dtype=np.int8)  # fmt: skip


def _iq4_nl_w8(raw: np.ndarray, cols: int) -> KernelGroups:
    blocks = _blocks(raw, cols, GROUP, 18)
    codes = IQ4_VALUES[_nibbles(blocks[..., 2:])]
    return KernelGroups(codes.reshape(raw.shape[0], cols), _f16(blocks[..., 0:2]), None)


def _iq4_xs_w8(raw: np.ndarray, cols: int) -> KernelGroups:
    """IQ4_XS: sub-block i's 6-bit scale ls is nibble i % 2 of scales_l[i // 2] with bits
    2 i, 2 i + 1 of scales_h on top; its 16 bytes of nibbles are laid out as IQ4_NL's."""
    rows = raw.shape[0]
    blocks = _blocks(raw, cols, QK_K, 136)
    high = np.ascontiguousarray(blocks[..., 2:4]).view("<u2")  # [r, s, 1]
    high = (high >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [r, s, 8]
    low = blocks[..., 4:8, None] >> np.array([0, 4], dtype=np.uint8)  # [r, s, 4, 2]
    ls = (low.reshape(high.shape) & 0x0F) | (high.astype(np.uint8) << 4)
    scale = _f16(blocks[..., 0:2])[..., None] * (ls.astype(np.float32) - 32)  # exact in float32
    codes = IQ4_VALUES[_nibbles(blocks[..., 8:].reshape(rows, -1, 8, 16))]
    return KernelGroups(codes.reshape(rows, cols), scale.reshape(rows, -1), None)


Decoder = Callable[[np.ndarray, int], KernelGroups]


@dataclass(frozen=True)
class BlockType:
    """One GGUF type's kernel mappings: kernel family ("w4" / "w5" / "w6" / ...) -> decoder,
    in preference order; `rounded` names the families whose fp16 scales round the stored
    values."""

    block_len: int
    decoders: dict[str, Decoder]
    rounded: frozenset[str] = frozenset()

    def is_exact(self, family: str) -> bool:
        return family in self.decoders and family not in self.rounded


BLOCK_TYPES: dict[str, BlockType] = {
    "Q4_0": BlockType(
        GROUP, {"w4": _q4_0_w4, "w5": _q4_0_split, "w6": _q4_0_split, "w8": _q4_0_w8}
    ),
    "Q4_1": BlockType(GROUP, {"w4": _q4_1_w4}),
    "Q5_0": BlockType(GROUP, {"w5": _q5_0_split, "w6": _q5_0_split, "w8": _q5_0_w8}),
    "Q5_1": BlockType(GROUP, {"w5m": _q5_1_split, "w6m": _q5_1_split}),
    "Q8_0": BlockType(GROUP, {"w8": _q8_0_w8}),
    "Q3_K": BlockType(QK_K, {"w5": _q3_k_split, "w6": _q3_k_split}),
    "Q4_K": BlockType(QK_K, {"w4": _q4_k_w4}, rounded=frozenset({"w4"})),
    "Q5_K": BlockType(
        QK_K, {"w5m": _q5_k_split, "w6m": _q5_k_split}, rounded=frozenset({"w5m", "w6m"})
    ),
    "Q6_K": BlockType(QK_K, {"w6": _q6_k_w6}),
    "IQ4_NL": BlockType(GROUP, {"w8": _iq4_nl_w8}),
    "IQ4_XS": BlockType(QK_K, {"w8": _iq4_xs_w8}, rounded=frozenset({"w8"})),
}
# Preference: fewer bytes streamed per weight first (5.0, 6.0, 6.5, 7.0, 7.5, 8.5 bits).
FAMILIES = ("w4", "w5", "w5m", "w6", "w6m", "w8")


def common_family(type_names: list[str], families: tuple[str, ...] = FAMILIES) -> str | None:
    """The first of `families` every listed GGUF type maps onto (a fused projection's shards
    must share one), or None when they have none in common."""
    for family in families:
        if all(family in getattr(BLOCK_TYPES.get(t), "decoders", {}) for t in type_names):
            return family
    return None


def decode(raw: np.ndarray, type_name: str, family: str, cols: int) -> KernelGroups:
    """Raw blocks [rows, row bytes] of a GGUF tensor with `cols` inputs -> kernel terms."""
    block_type = BLOCK_TYPES.get(type_name)
    if block_type is None or family not in block_type.decoders:
        raise ValueError(f"GGUF type {type_name} has no {family} mapping")
    return block_type.decoders[family](raw, cols)
