"""The delta-rule decode kernel (Gated DeltaNet, KDA) against torch at Qwen3-Next's shape
(`python -m densa_bench.delta_rule.runner`)."""
