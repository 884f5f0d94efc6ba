"""Storing a step's new K or V into its page slots on the GPU (Triton), quantizing for FP8.

One program per new token: it reads the token's [KVH, D] row and writes slot
(slot_pages[t], slot_offsets[t]) of every head's page, for any cache dtype:

    bf16 / fp16 / fp32 pages   cast
    fp8, static scale          e4m3(clamp(x * (1 / scale)))
    fp8, dynamic scales        per (token, head): the power-of-two exponent e that puts the row's
                               max|x| in (224, 448], then e4m3(x * 2**-e); e goes to the scales

bit for bit what `densa.kernels.cpu.kv_store.store_fp8` and the torch references store. A token
whose page id is negative is skipped: CUDA-graph padding rows use that, so they write nowhere.
"""

from __future__ import annotations

import torch

from densa.formats.fp8_kv import EXPONENT_SCALE_DTYPE, FP8_DTYPE
from densa.formats.kv_format import KVFormat
from densa.kernels.triton.common import (
    SCALE_NONE,
    SCALE_STATIC,
    next_power_of_2,
    or_dummy,
    require_triton,
    scale_mode,
    token_scale_strides,
    triton,
)

if triton is not None:
    import triton.language as tl

    from densa.kernels.triton.common import bf16_bits, encode_e4m3, finite, row_exponent

    @triton.jit
    def _store_kernel(
        x_ptr, cache_ptr, scale_ptr, pages_ptr, offsets_ptr,
        stride_xt, stride_xh,
        stride_cp, stride_ch, stride_cs,
        stride_sp, stride_sh,
        NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        FP8: tl.constexpr, SCALES: tl.constexpr, TO_BF16: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0)
        page = tl.load(pages_ptr + token).to(tl.int64)
        if page < 0:
            return
        slot = tl.load(offsets_ptr + token).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
        x = tl.load(
            x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :], mask=mask
        )  # [BLOCK_H, BLOCK_D]
        dest = cache_ptr + page * stride_cp + heads[:, None] * stride_ch + slot * stride_cs
        if TO_BF16:  # cache_ptr is the bf16 cache viewed as int16
            tl.store(dest + dims[None, :], bf16_bits(x.to(tl.float32)), mask=mask)
            return
        if not FP8:
            tl.store(dest + dims[None, :], x.to(cache_ptr.dtype.element_ty), mask=mask)
            return
        x = finite(x.to(tl.float32))
        if SCALES == 1:  # static: multiply by the float32 reciprocal, as the reference does
            y = x * (1.0 / tl.load(scale_ptr))
            y = tl.where(y != y, 0.0, y)
        else:  # dynamic: one power-of-two exponent per (token, head)
            amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)  # [BLOCK_H]
            exponent = row_exponent(amax)
            inv_scale = ((127 - exponent) << 23).to(tl.float32, bitcast=True)  # 2**-e, exact
            y = x * inv_scale[:, None]
            scale_dest = scale_ptr + page * stride_sp + heads * stride_sh + slot
            tl.store(scale_dest, exponent.to(tl.int8), mask=heads < NUM_HEADS)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(dest + dims[None, :], encode_e4m3(y), mask=mask)


def store_kv(
    cache: torch.Tensor,
    scale: torch.Tensor | None,
    slot_pages: torch.Tensor,
    slot_offsets: torch.Tensor,
    x: torch.Tensor,
    kv_format: KVFormat | None = None,
) -> None:
    """Write x [T, KVH, D] into slot (slot_pages[t], slot_offsets[t]) of cache [P, KVH, S, D].

    FP8 caches: `scale` is None (static 1.0), a 0-dim float32 (static) or an int8 exponent
    tensor [P, KVH, S] (dynamic; filled here). Tokens with slot_pages[t] < 0 are skipped.
    """
    require_triton()
    is_fp8 = cache.dtype == FP8_DTYPE
    if scale is not None and not is_fp8:
        raise ValueError("scales are only written for float8 caches")
    if is_fp8 and scale is None:
        scale = torch.ones((), dtype=torch.float32, device=cache.device)
    mode = scale_mode(scale, kv_format)
    dynamic = mode not in (SCALE_NONE, SCALE_STATIC)
    if dynamic and scale is not None and scale.dtype != EXPONENT_SCALE_DTYPE:
        raise ValueError("dynamic fp8 scales are stored as int8 exponents")
    if x.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("store_kv needs a contiguous head_dim")
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens == 0:
        return
    to_bf16 = cache.dtype == torch.bfloat16 and x.dtype != torch.bfloat16
    # Raw views where the kernel writes bits it encoded itself.
    target = cache.view(torch.uint8) if is_fp8 else cache.view(torch.int16) if to_bf16 else cache
    stride_sp, stride_sh = token_scale_strides(scale)
    _store_kernel[(num_tokens,)](
        x, target, or_dummy(scale, x), slot_pages, slot_offsets,
        x.stride(0), x.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2),
        stride_sp, stride_sh,
        NUM_HEADS=num_heads, BLOCK_H=next_power_of_2(num_heads),
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        FP8=is_fp8, SCALES=mode, TO_BF16=to_bf16,
    )  # fmt: skip
