"""Numeric formats: FP8 KV cache pages and quantized (INT4, FP8) linear-layer weights."""
