"""CPU kernels: Numba (fused, parallel, widening narrow values in registers) and densa's C++
extension (csrc/, compiled once per machine and loaded by native.py; `python -m
densa.kernels.cpu.native` builds it ahead of time, as scripts/setup.sh does).

    paged decode attention   paged_attention.paged_decode_attention (one fused Numba kernel)
    prefill attention        prefill_attention.paged_prefill_attention (tiled over pages, C++)
    KV store                 kv_store.store_kv (fused Numba FP8 store; torch for other formats)
    quantized linear         int4_linear.cpu_int4_linear, fp8_linear.fp8_linear,
                             qgemm.quantized_linear (w4a8, w5a8, w5ma8, w6a8, w6ma8, w8a8,
                             w8: C++),
                             grouped_linear.grouped_linear (MoE experts), linear.linear (fp32)
    integrity check          none of its own: the torch tag check is one gather on the CPU
    fused decode step        the C++ decoder (csrc/decoder.cpp), driven by model/fused_decode.py
    grammar mask             token_bitmask.apply_token_bitmask_

numba_threads picks Numba's threading layer before any parallel kernel runs; numba_intrinsics
holds the LLVM-level building blocks the attention and store kernels share.

Numba (with llvmlite, ~55 MiB resident) is imported on the first call that needs it, never by
importing the model code: the streaming matmuls (streaming_matmul), the FP8 store (fp8_kv_store)
and decode attention (paged_attention) live in modules their callers import at that call, and
the grammar mask compiles its loop on first use. A GGUF server on the C++ kernels with INT8 KV
runs none of them (tests/engine/test_engine_memory.py).
"""
