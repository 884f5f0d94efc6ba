#!/bin/bash
# Every GGUF type at real size (issue 21, points 1 and 8): requantize the Qwen2.5-Coder-1.5B
# Q4_K_M into each type with llama.cpp's llama-quantize, then compare densa's execution of each
# file's own blocks with the same file dequantized to float32. Run from the repository root
# after `scripts/setup.sh models` and the peers profile (llama.cpp built under .peers/):
#   cmake --build .peers/build --target llama-quantize -j2
#   docs/eval/gguf_types_1.5b/run.sh [q8_0 q6_k q5_k_m q3_k_m q4_0 q5_0]
# Requantizing adds error to the model, not to what is measured: the reference is the
# dequantized fp32 of the SAME file. One 1.5B process at a time (~13 min per type on 2 cores).
set -euo pipefail
models=${DENSA_CACHE_DIR:-$HOME/.cache/densa}/models
source=$models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
types=("${@:-q8_0 q6_k q5_k_m q3_k_m q4_0 q5_0}")
for t in ${types[@]}; do
  file=$models/qwen2.5-coder-1.5b-instruct-requant-$t.gguf
  if [ ! -f "$file" ]; then
    .peers/build/bin/llama-quantize --allow-requantize "$source" "$file.tmp" "${t^^}" 2
    mv "$file.tmp" "$file"
  fi
  .venv/bin/densa eval distribution --model "$file" \
    --ref dequantized-fp32:weight_format=dense,head_format=dense \
    --test gguf-blocks:weight_format=auto,head_format=auto --tokens 4096 \
    --kv-cache-dtype float32 --max-model-len 1024 --kv-cache-memory 1GiB \
    --out "docs/eval/gguf_${t}_1.5b"
done
.venv/bin/python docs/eval/gguf_types_1.5b/resident.py "$models"/qwen2.5-coder-1.5b-instruct-*.gguf
