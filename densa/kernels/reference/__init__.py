"""Slow, obviously-correct torch versions of the kernels, over any cache layout the kernels take
(including float32 per-token scales no engine format stores): the tests' yardstick.

    paged decode attention   paged_attention.paged_attention_reference (query_len 1)
    prefill attention        paged_attention.paged_attention_reference (any query_len, new_kv)
    KV store                 paged_attention.write_kv_reference
    dequantize pages         paged_attention.dequantize_pages
    quantized linear         next to each CPU kernel, in plain torch: int4_linear_ref,
                             fp8_linear_ref, grouped_linear_ref, qgemm's *_reference
    integrity check          integrity.mismatching_rows, the torch tag check the engine runs
    delta-rule decode        delta_rule.delta_rule_decode_reference (and _steps: T tokens)
"""
