#!/usr/bin/env bash
# The H200 check: Triton kernels against their torch references, kernel timings against the HBM
# roofline, and an end-to-end sweep of densa's engine on a random-weight ~1.1B Llama
# (BF16 vs FP8 KV, BF16 vs INT4 weights, integrity on vs off; c = 1, 8, 16, 32, 64).
# Written for a bare GPU machine: torch, triton and transformers present, no network, no
# install step (densa runs from this source tree). About 7 minutes; results under $OUT.
#
#   OUT=/some/dir bash scripts/gpu_check.sh          # on the GPU machine
#   python -m densa_bench.gpu.report $OUT/gpu_check.json   # tables + plots -> docs/benchmarks/gpu/
#
# docs/benchmarks/gpu/README.md says what is measured and how to read it.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$root/gpu-check-out}"
python="${PYTHON:-python3}"
budget="${DENSA_GPU_CHECK_BUDGET:-400}"  # seconds for the Python driver; hard stop at +70
mkdir -p "$out"

# Wheels carried for packages the machine lacks (none are needed today): .whl/*.whl
if compgen -G "$root/.whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/densa-site "$root"/.whl/*.whl || exit 2
  export PYTHONPATH="/tmp/densa-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
# Preflight: every module the check imports (densa_bench.gpu.check.CHECK_MACHINE_MODULES).
if ! "$python" - <<'PY'
import importlib, sys
from densa_bench.gpu.check import CHECK_MACHINE_MODULES
missing = []
for name in sorted(CHECK_MACHINE_MODULES - {"matplotlib"}):
    try:
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '')}")
    except Exception as exc:  # ImportError, or a broken install raising something else
        missing.append(f"{name} ({exc!r})")
if missing:
    sys.exit("[gpu_check] missing on this machine, carry them as wheels in .whl/: " + ", ".join(missing))
PY
then
  exit 2
fi

timeout --signal=INT --kill-after=10 "$((budget + 70))" \
  "$python" -m densa_bench.gpu.check --out "$out" --time-budget "$budget" "$@" 2>&1 \
  | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}
# Tables and plots next to the JSON, so one run brings everything back.
if [ -f "$out/gpu_check.json" ]; then
  "$python" -m densa_bench.gpu.report "$out/gpu_check.json" --out "$out/report" || true
fi
exit "$status"
