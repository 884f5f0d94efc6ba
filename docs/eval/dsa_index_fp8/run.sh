#!/bin/sh
# The tiny GLM-5 (tests/tiny_families.py: index_topk 16, random weights, SmolLM2's tokenizer),
# BF16 latent pages; index keys BF16 (reference) vs FP8 with block scales.
set -e
python -c "
from pathlib import Path
from tests.tiny_families import save_tiny
from densa.model.loader import resolve_model_dir
from densa.setup.args import default_model_path
save_tiny('glm_moe_dsa', Path('$1'), resolve_model_dir(default_model_path()))"
python docs/eval/dsa_index_fp8/topk_overlap.py "$1" --segments 8 --segment-len 256
densa eval distribution --model "$1" --kv-cache-dtype bfloat16 \
    --ref bf16-index:index_kv_dtype=bfloat16 --test fp8-index:index_kv_dtype=fp8_e4m3 \
    --tokens 2048 --segment-len 256 --chunk-size 1 --max-model-len 512 \
    --kv-cache-memory 64MiB --out docs/eval/dsa_index_fp8
