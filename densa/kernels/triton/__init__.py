"""Triton kernels: compiled on a GPU, and run on the CPU by Triton's interpreter
(TRITON_INTERPRET=1), which is how the suite checks them against the torch references.

    paged decode attention   decode_attention.paged_decode_attention (split-K)
    prefill attention        prefill_attention.paged_prefill_attention (varlen, paged)
    sparse MLA decode        sparse_latent_decode.sparse_latent_decode (DSA: top-k latent rows)
    KV store                 kv_store.store_kv (cast, or quantize to FP8 with its scales)
    quantized linear         int4_linear.int4_linear_triton, fp8_linear.fp8_linear_triton
                             (launch configurations: tuning.py)
    integrity check          integrity.check_tags (one launch before the forward pass)

common.py: whether Triton is here, the interpreter switch, shared device functions. Importing
this package imports no Triton; its modules do, and are imported only when a backend asks.
"""
