#!/usr/bin/env bash
# Set up (first run) and start the OpenAI-compatible server on http://127.0.0.1:8000.
# Extra arguments go to `densa serve` (see `densa serve --help`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh" runtime
exec "$root/.venv/bin/densa" serve "$@"
