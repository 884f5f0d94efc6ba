"""What densa's Triton kernels share: whether Triton is here, the interpreter switch, and small
device functions (matrix products, FP8 scales, the e4m3 encoder).

Every kernel runs in two places: compiled on a GPU, and on the CPU through Triton's interpreter
(TRITON_INTERPRET=1), which is how the test suite checks them against their torch references on
machines without a GPU. Two interpreter defects shape the code (seen in Triton 3.6 and 3.9):

- `tl.dot` on bfloat16 operands returns garbage, so products go through `mma`, which widens its
  operands to float32 when interpreting. On a GPU the operands stay 16-bit (tensor cores).
- float32 -> float8e4nv casts round wrongly near binade edges, and float32 -> bfloat16 casts
  truncate, so the KV store encodes e4m3 and bf16 bits by hand (`encode_e4m3`, `bf16_bits`),
  bit for bit what torch's casts give, on both. (Inside attention, where values are rounded
  only on their way into a matrix product, the interpreter's truncation is within tolerance.)

Only Triton APIs present since Triton 3.0 are used (the H200 check runs Triton 3.6): tl.load /
tl.store with masks, tl.dot with an accumulator, tl.exp2, reductions, bitcasts, tl.atomic_add.
"""

from __future__ import annotations

import functools
import os

import torch

from densa.formats.kv_format import DYNAMIC, NO_SCALES, STATIC, KVFormat, is_layer_scale

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: CPU-only installs never reach these kernels
    triton = None
    tl = None

# How a kernel reads a K/V cache's scales (see densa.kernels.reference.paged_attention):
SCALE_NONE = 0  # no scales: the stored value is the value
SCALE_STATIC = 1  # one float32 for the whole layer (a 0-dim tensor)
SCALE_TOKEN_FLOAT = 2  # [pages, kv_heads, page_size] float32, one per token and head
SCALE_TOKEN_EXPONENT = 3  # the same shape, int8 power-of-two exponents e (scale = 2**e)
# The mode each KV encoding (KVFormat.scales) stores its scales in.
_ENCODING_MODES = {NO_SCALES: SCALE_NONE, STATIC: SCALE_STATIC, DYNAMIC: SCALE_TOKEN_EXPONENT}


def is_available() -> bool:
    return triton is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_triton() -> None:
    if triton is None:
        raise RuntimeError("densa's GPU kernels need Triton: pip install triton")


@functools.cache
def _device_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a GPU (grids are sized by it); 4 when interpreting on a CPU,
    so tests still cover split work."""
    if device.type != "cuda":
        return 4
    return _device_multiprocessors(device.index if device.index is not None else 0)


def scale_mode(scale: torch.Tensor | None, kv_format: KVFormat | None = None) -> int:
    """How to read `scale`: as the pages' KVFormat says (the engine's caches carry theirs), or,
    for pages made by hand (tests, benchmarks: float32 per-token scales too), off the tensor."""
    if scale is None:
        return SCALE_NONE
    if kv_format is not None and kv_format.scales in _ENCODING_MODES:
        return _ENCODING_MODES[kv_format.scales]
    if is_layer_scale(scale, None):
        return SCALE_STATIC
    return SCALE_TOKEN_EXPONENT if scale.dtype == torch.int8 else SCALE_TOKEN_FLOAT


def token_scale_strides(*scales: torch.Tensor | None) -> tuple[int, int]:
    """(page, head) strides of the per-token scale tensors [P, KVH, S] among `scales` (K's and
    V's share one layout), or (0, 0) when there are none."""
    for scale in scales:
        if scale is not None and scale.dim() == 3:
            if scale.stride(2) != 1:
                raise ValueError("per-token scales need a contiguous slot dimension")
            return scale.stride(0), scale.stride(1)
    return 0, 0


def check_layouts(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *rows: torch.Tensor
) -> None:
    """What the attention kernels assume: a contiguous head_dim everywhere, and K and V pages
    laid out alike (one set of cache strides serves both)."""
    if any(t.stride(-1) != 1 for t in (query, k_cache, v_cache, *rows)):
        raise ValueError("the attention kernels need a contiguous last (head_dim) dimension")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("K and V pages must share one layout")


def or_dummy(tensor: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Kernels take a pointer even for an absent operand (they never read it then)."""
    return like if tensor is None else tensor


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def mma(a, b, acc, WIDEN: tl.constexpr):
        """acc + a @ b in float32; WIDEN (interpreter only) computes it on float32 copies."""
        if WIDEN:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def token_scales(scale_ptr, rows, mask, MODE: tl.constexpr):
        """float32 scales of the tokens at element offsets `rows` of a per-token scale tensor:
        MODE 2 (SCALE_TOKEN_FLOAT) float32, MODE 3 (SCALE_TOKEN_EXPONENT) int8 exponents."""
        if MODE == 2:
            return tl.load(scale_ptr + rows, mask=mask, other=1.0).to(tl.float32)
        exponent = tl.load(scale_ptr + rows, mask=mask, other=0).to(tl.int32)
        return ((exponent + 127) << 23).to(tl.float32, bitcast=True)  # 2**e, exact

    @triton.jit
    def block_scales(scale_ptr, rows, mask, MODE: tl.constexpr):
        """float32 [n] multipliers of the tokens at `rows`, for any scale MODE: 1.0 (none), the
        layer's static scale, or each token's own."""
        ones = (rows * 0).to(tl.float32) + 1.0
        if MODE == 0:
            return ones
        if MODE == 1:
            return ones * tl.load(scale_ptr)
        return token_scales(scale_ptr, rows, mask, MODE)

    @triton.jit
    def finite(x):
        """NaN -> 0, +-inf -> +-FLT_MAX, as torch.nan_to_num does in the references."""
        x = tl.where(x != x, 0.0, x)
        return tl.minimum(tl.maximum(x, -3.4028234663852886e38), 3.4028234663852886e38)

    @triton.jit
    def encode_e4m3(y):
        """float32 y with |y| <= 448 -> float8_e4m3fn bits (uint8), rounding to nearest even.

        Normal range: round the float32 mantissa to 3 bits on the bit pattern (add half an e4m3
        ulp minus one plus the kept lsb) and rebias the exponent (127 -> 7). Below e4m3's
        smallest normal (2**-6) the codes are multiples of 2**-9: the code is rint(|y| * 512).
        """
        bits = y.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        magnitude = bits & 0x7FFFFFFF
        lsb = (magnitude >> 20) & 1
        normal = ((magnitude + 0x7FFFF + lsb) >> 20) - 960
        scaled = tl.abs(y) * 512.0  # in [0, 8) where used
        rounded = tl.floor(scaled + 0.5)
        # Ties go to the even code: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2 ...
        tie_to_odd = (rounded - scaled == 0.5) & ((rounded.to(tl.int32) & 1) == 1)
        subnormal = rounded.to(tl.int32) - tie_to_odd.to(tl.int32)
        code = tl.where(tl.abs(y) < 0.015625, subnormal, normal)
        return (sign | code).to(tl.uint8)

    @triton.jit
    def bf16_bits(x):
        """float32 -> bfloat16 bits (int16), rounding to nearest even as torch does (the
        interpreter's own cast truncates); NaN stays NaN."""
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)

    @triton.jit
    def row_exponent(amax):
        """The int8 exponent e of the smallest power-of-two scale with amax <= 448 * 2**e, from
        amax's float32 bits (amax = 1.m * 2**(b - 127): e = b - 135, plus 1 when 1.m > 1.75),
        clamped to [-126, 119]; 0 for a zero row. Matches `scale_exponents`."""
        bits = amax.to(tl.int32, bitcast=True)
        biased = bits >> 23
        e = biased - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        e = tl.minimum(tl.maximum(e, -126), 119)
        return tl.where(amax == 0, 0, e)
