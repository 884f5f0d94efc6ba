"""FP4 weight kernels against densa's INT4 kernels at a real model's shapes
(`python -m densa_bench.fp4.runner`)."""
