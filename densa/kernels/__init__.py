"""densa's kernels, one package per backend, each offering the same operations:

    reference/  slow, obviously-correct torch: what every kernel test compares against
    cpu/        Numba kernels and densa's C++ extension (csrc/, built by cpu/native.py)
    triton/     Triton kernels: compiled on a GPU, interpreted on the CPU in the tests

    operation                reference                   cpu                      triton
    paged decode attention   paged_attention_reference   paged_decode_attention   the same name
    prefill attention        paged_attention_reference   paged_prefill_attention  the same name
    KV store                 write_kv_reference          store_kv                 store_kv
    quantized linear         *_ref / *_reference         int4, fp8, packed        int4, fp8
    integrity check          (torch: worker/integrity)   (torch: worker/integrity)  check_tags

Every backend reads the layouts and scale math of densa.formats (and is handed the pages'
KVFormat); nothing here imports densa.quant, which builds on the kernels.
"""
