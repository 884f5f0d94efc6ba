"""Micro-benchmark of the CPU paged-attention kernels (`python -m densa_bench.attention.runner`)."""
