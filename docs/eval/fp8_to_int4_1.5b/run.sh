#!/bin/bash
# usage: run.sh MODEL WORK TOKENS OUT
set -ex
MODEL=$1; W=$2; TOKENS=$3; OUT=$4
cd /tmp/h-ckpt
export PYTHONPATH=/tmp/h-ckpt
PY=/work/main/.venv/bin/python
date -u
[ -d $W/bf16 ] || $PY -m densa.cli quantize $MODEL $W/bf16 --weights bf16
date -u
[ -d $W/fp8 ] || $PY /tmp/ckpt-q/fp8_shipped.py $W/bf16 $W/fp8
date -u
[ -d $W/int4 ] || $PY -m densa.cli quantize $W/fp8 $W/int4 --weights int4 --group-size 32
date -u
$PY -m densa.cli eval distribution --tokens $TOKENS --segment-len 64 --model $W/bf16 --dtype float32 \
  --test fp8-shipped:model=$W/fp8 --test int4-g32-from-fp8:model=$W/int4 --out $OUT
date -u
