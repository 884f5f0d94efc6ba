#!/bin/bash
# usage: run.sh WORK TOKENS OUT   (from the repository root; ~1 h on 2 busy cores)
# Qwen2.5-Coder-1.5B's dense weights (the GGUF dequantized to BF16, the reference) quantized by
# `densa quantize` to INT4 g128 (RTN, symmetric), MXFP4 and NVFP4 (RTN); next-token KL and top-1
# agreement against the BF16 reference computed in float32, LAMBADA text.
set -ex
W=$1; TOKENS=$2; OUT=$3
PY=${PY:-/work/main/.venv/bin/python}
MODEL=${MODEL:-$HOME/.cache/densa/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}
date -u
[ -d $W/bf16 ] || $PY -m densa.cli quantize $MODEL $W/bf16 --weights bf16
for f in int4 mxfp4 nvfp4; do
  date -u
  [ -d $W/$f ] || $PY -m densa.cli quantize $W/bf16 $W/$f --weights $f --group-size 128
done
date -u
$PY -m densa.cli eval distribution --tokens $TOKENS --segment-len 64 --model $W/bf16 --dtype float32 \
  --test int4-g128-rtn:model=$W/int4 --test mxfp4:model=$W/mxfp4,weight_format=mxfp4 \
  --test nvfp4:model=$W/nvfp4,weight_format=nvfp4 \
  --test mxfp4-int8-activations:model=$W/mxfp4,weight_format=mxfp4a8 --out $OUT
# (the recorded run said weight_format=auto for the mxfp4 / nvfp4 rows: weight-only then, the
# int8 kernels since; the explicit formats above give the recorded run's kernels)
date -u
