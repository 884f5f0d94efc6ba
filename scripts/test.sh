#!/usr/bin/env bash
# Set up (first run: the dev tools and the real 0.5B model) and run every check: ruff lint +
# format, mypy, and the pytest suite.
# Extra arguments go to pytest (e.g. `scripts/test.sh -k scheduler`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh dev
scripts/setup.sh models-small  # the real Qwen2.5-Coder-0.5B for tests/model/test_catalog.py (~490 MB)
echo "[densa] ruff check";  .venv/bin/ruff check densa densa_bench tests
echo "[densa] ruff format"; .venv/bin/ruff format --check densa densa_bench tests
echo "[densa] mypy";        .venv/bin/mypy
echo "[densa] pytest";      .venv/bin/python -m pytest "$@"
