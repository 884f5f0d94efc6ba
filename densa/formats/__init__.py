"""How numbers are stored: layouts and scale math, below every kernel that reads them and every
quantizer that writes them (torch only; imports neither densa.kernels nor densa.quant).

    kv_format   KVFormat: a KV cache's storage dtype and scale encoding, sizes, decoding
    fp8_kv      FP8 (e4m3) KV pages: scale policies, static scale files, reference quantizers
    int8_kv     INT8 KV pages: codes and one fp16 scale per row
    int4        INT4 weights: nibble packing, group scales and zeros
    fp8_blocks  FP8 weights with block scales: their runtime row scales, dequantization
    fp4         MXFP4 / NVFP4 weights: e2m1 codes, E8M0 / e4m3 block scales, the reference
"""
