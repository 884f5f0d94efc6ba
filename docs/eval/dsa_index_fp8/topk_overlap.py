"""How often FP8 index keys choose the tokens BF16 keys choose: the indexer's top-k overlap.

Runs a sparse-attention model token by token (decode steps, BF16 latent pages and BF16 index
keys: the reference) over LAMBADA segments; every full indexer layer also stores the same keys
in a shadow FP8 index cache (block scales, Hadamard-rotated, as densa stores FP8 keys) and
selects from it with the same queries. Overlap = |S_bf16 & S_fp8| / k, over every (layer,
position) whose context is longer than k; 95% CI by bootstrap over segments.

    python docs/eval/dsa_index_fp8/topk_overlap.py MODEL_DIR [--segments 16 --segment-len 256]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig
from densa.model.attention import AttentionMetadata, CpuAttentionBackend, build_group
from densa.model.dsa import Indexer
from densa.model.kv_layout import LatentKVCache
from densa.model.loader import load_model
from densa.text.tokenizer import Tokenizer
from densa.model.kv_pages import allocate_kv_caches
from densa_bench.eval.distribution import text_segments
from densa_bench.eval.stats import ratio_ci

PAGE = 16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--segments", type=int, default=16)
    parser.add_argument("--segment-len", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "topk_overlap.json")
    ns = parser.parse_args()
    arch = ArchConfig.from_dir(ns.model_dir)
    cpu = torch.device("cpu")
    model = load_model(ns.model_dir, arch, "float32", ns.segment_len, cpu)
    pages = -(-ns.segment_len // PAGE)
    caches = allocate_kv_caches(arch, pages, PAGE, KVFormat.of("bfloat16"), cpu)
    shadow_format = KVFormat.of("bfloat16", index_dtype="fp8_e4m3")
    shadow = allocate_kv_caches(arch, pages, PAGE, shadow_format, cpu)
    shadow_of = {id(c.index): s.index for c, s in zip(caches, shadow, strict=True)
                 if isinstance(c, LatentKVCache) and c.index is not None}  # fmt: skip
    overlaps: list[float] = []  # this segment's overlap fractions
    original = Indexer.forward

    def forward(self, hidden, q_latent, rope, cache, meta):  # type: ignore[no-untyped-def]
        chosen = original(self, hidden, q_latent, rope, cache, meta)
        fp8 = original(self, hidden, q_latent, rope, shadow_of[id(cache)], meta)
        if chosen.decode is not None and fp8.decode is not None:
            a, b = set(chosen.decode[0].tolist()) - {-1}, set(fp8.decode[0].tolist()) - {-1}
            overlaps.append(len(a & b) / max(len(a), 1))
        return chosen

    Indexer.forward = forward  # type: ignore[method-assign]
    tokenizer = Tokenizer.from_dir(ns.model_dir)
    sums, counts = [], []
    backend = CpuAttentionBackend()
    with torch.inference_mode():
        for segment in text_segments(tokenizer, ns.segments, ns.segment_len):
            overlaps.clear()
            for pos, token in enumerate(segment):
                group = build_group(0, [list(range(pos // PAGE + 1))], [pos + 1], [1], PAGE, cpu)
                meta = AttentionMetadata(torch.tensor([pos // PAGE]), torch.tensor([pos % PAGE]),
                                         group, None)  # fmt: skip
                model(torch.tensor([token]), torch.tensor([pos]), caches, meta, backend)
            sums.append(sum(overlaps))
            counts.append(len(overlaps))
    estimate = ratio_ci(np.array(sums), np.array(counts))
    result = {"model": str(ns.model_dir), "segments": ns.segments, "segment_len": ns.segment_len,
              "topk": arch.dsa.topk if arch.dsa else None, "choices_compared": int(sum(counts)),
              "topk_overlap": estimate.to_json()}  # fmt: skip
    ns.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
