#!/usr/bin/env bash
# Set up (first run) and start the OpenAI-compatible server on http://127.0.0.1:8000.
# Extra arguments go to `densa serve` (see `densa serve --help`).
# KV pages are INT8 (1.94x BF16's tokens, KL 0.0002 vs BF16 KV, per-request cost within FP8's:
# docs/kv-cache.md); a --kv-cache-dtype given here comes later on the line and wins.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh" runtime
exec "$root/.venv/bin/densa" serve --kv-cache-dtype int8 "$@"
