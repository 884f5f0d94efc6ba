"""LLVM-level building blocks for the Numba attention kernels: widening narrow cache elements to
float32 in registers, power-of-two scaling, prefetching, and an inlinable float32 exp."""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# All fast-math flags except nnan/ninf: the online softmax starts from a large negative sentinel
# and we want inf/NaN in the cache to propagate visibly rather than be optimized into garbage.
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}


def _widen_typer(typingctx, raw):
    """Raw cache element -> float32, in registers (vectorizes; no lookup tables).

    float32: identity. int16 (bf16 bits): shift into the high half of a 32-bit float.
    uint16 (fp16 bits): hardware fp16 -> fp32 conversion. uint8 (e4m3fn bits): repack sign,
    exponent and mantissa into fp16 bits (exact, subnormals included) and convert; the result
    is the true value / 256. The e4m3 NaN code (0x7f/0xff) is not special-cased (reads as 480).
    int8 (INT8 KV codes): signed integer -> float32.
    """
    f32 = ir.FloatType()
    i16 = ir.IntType(16)

    def half_bits_to_f32(builder: ir.IRBuilder, bits: ir.Value) -> ir.Value:
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), f32)

    def codegen(context, builder, signature, args):
        (x,) = args
        if raw == types.float32:
            return x
        if raw == types.int16:
            wide = builder.zext(x, ir.IntType(32))
            return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), f32)
        if raw == types.uint16:
            return half_bits_to_f32(builder, x)
        if raw == types.int8:
            return builder.sitofp(x, f32)
        wide = builder.zext(x, i16)
        sign = builder.shl(builder.and_(wide, ir.Constant(i16, 0x80)), ir.Constant(i16, 8))
        magnitude = builder.shl(builder.and_(wide, ir.Constant(i16, 0x7F)), ir.Constant(i16, 7))
        return half_bits_to_f32(builder, builder.or_(sign, magnitude))

    if raw not in (types.float32, types.int16, types.uint16, types.uint8, types.int8):
        return None
    return types.float32(raw), codegen


def _pow2_typer(typingctx, exponent):
    """2.0 ** exponent as float32, built from the exponent bits (exponent in [-126, 127])."""

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        biased = builder.add(builder.trunc(args[0], i32), ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(biased, ir.Constant(i32, 23)), ir.FloatType())

    if not isinstance(exponent, types.Integer):
        return None
    return types.float32(exponent), codegen


def _scale_typer(typingctx, raw):
    """A dynamic scale entry -> float32 multiplier: float32 as is; uint16 (fp16 bits, INT8 KV's
    row scales) by the hardware conversion; an int8 power-of-two exponent e (any in [-126, 127])
    -> 2**e, built from the exponent bits (no table, no libm call)."""

    def codegen(context, builder, signature, args):
        (x,) = args
        if raw == types.float32:
            return x
        if raw == types.uint16:
            return builder.fpext(builder.bitcast(x, ir.HalfType()), ir.FloatType())
        i32 = ir.IntType(32)
        biased = builder.add(builder.sext(x, i32), ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(biased, ir.Constant(i32, 23)), ir.FloatType())

    if raw not in (types.float32, types.int8, types.uint16):
        return None
    return types.float32(raw), codegen


def _prefetch_typer(typingctx, array, index):
    """Hint the CPU to pull the cache line holding array.flat[index] into cache."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        address = builder.bitcast(builder.gep(data, [args[1]]), i8p)
        # read access, high temporal locality, data cache
        builder.call(fn, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    if not isinstance(array, types.Array) or not isinstance(index, types.Integer):
        return None
    return types.void(array, index), codegen


# Typed as Any: mypy cannot see through numba's intrinsic wrapper (it expects `typingctx`).
widen: Any = intrinsic(_widen_typer)
pow2: Any = intrinsic(_pow2_typer)
dynamic_scale: Any = intrinsic(_scale_typer)
prefetch: Any = intrinsic(_prefetch_typer)

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_MIN = np.float32(-87.0)  # exp(-87) ~ 1.6e-38 still normal; anything below rounds to ~0


@njit(fastmath=FASTMATH, cache=True, inline="always", nogil=True)
def exp_neg(x):
    """exp(x) for x <= 0 in float32 (Cephes expf polynomial, ~1 ulp); unlike libm's expf it is
    inlined and vectorizes across the softmax block."""
    x = max(x, _EXP_MIN)
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    return (p * r * r + r + np.float32(1.0)) * pow2(np.int32(n))
