"""Micro-benchmark of the CPU paged attention paths. Run: python -m densa_bench.attention.runner

Decode: fused Numba kernel vs the torch path (gather pages + SDPA, i.e. `paged_prefill_attention`
with query_len 1) vs the per-sequence torch reference. Prefill: the batched masked-SDPA path vs
one SDPA call per sequence. Shapes are SmolLM2-135M's (9 query / 3 KV heads, head_dim 64).

Every timed call reads a different copy of the cache (like consecutive layers of a model step),
so the KV data comes from DRAM rather than from a warm L3.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import numba
import torch
import torch.nn.functional as F

from densa.kernels.cpu.paged_attention import paged_decode_attention, paged_prefill_attention
from densa.kernels.reference.paged_attention import paged_attention_reference, write_kv_reference

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 9, 3, 64, 16
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)
COLD_BYTES = 96 * 2**20  # rotate over enough cache copies to overflow a 32 MiB L3 a few times
# k_cache, v_cache, k_scale, v_scale of one layer
LayerKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


class Layers:
    """`count` independent KV caches (one per "layer") for B sequences of seq_len tokens."""

    def __init__(self, batch: int, seq_len: int, dtype: torch.dtype, count: int) -> None:
        pages_per_seq = math.ceil(seq_len / PAGE_SIZE)
        num_pages = batch * pages_per_seq
        shape = (num_pages, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM)
        perm = torch.randperm(num_pages).to(torch.int32)
        self.page_table = perm.view(batch, pages_per_seq)  # scattered pages, like a real pool
        self.seq_lens = torch.full((batch,), seq_len, dtype=torch.int32)
        fp8 = dtype == torch.float8_e4m3fn
        self.caches: list[LayerKV] = []
        for _ in range(count):
            k_cache, v_cache = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
            k_scale = torch.ones(shape[:3]) if fp8 else None  # dynamic per-token-head scales
            v_scale = torch.ones(shape[:3]) if fp8 else None
            for i in range(batch):
                kv = torch.randn(2, seq_len, NUM_KV_HEADS, HEAD_DIM)
                write_kv_reference(k_cache, self.page_table[i], 0, kv[0], k_scale)
                write_kv_reference(v_cache, self.page_table[i], 0, kv[1], v_scale)
            self.caches.append((k_cache, v_cache, k_scale, v_scale))
        self.next = 0

    def take(self) -> LayerKV:
        self.next = (self.next + 1) % len(self.caches)
        return self.caches[self.next]

    @staticmethod
    def copies_for(batch: int, seq_len: int, dtype: torch.dtype) -> int:
        per_layer = 2 * batch * seq_len * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
        return max(2, min(16, math.ceil(COLD_BYTES / per_layer)))


class Timing:
    """Median and best of several timed runs, in milliseconds."""

    def __init__(self, fn: Callable[[], object], reps: int, warmup: int = 3) -> None:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        self.median, self.best = statistics.median(times), min(times)

    def __str__(self) -> str:
        return f"{self.median:8.3f} ({self.best:7.3f})"


def bench_decode(batch: int, seq_len: int, dtype_name: str, reps: int) -> str:
    dtype = DTYPES[dtype_name]
    layers = Layers(batch, seq_len, dtype, Layers.copies_for(batch, seq_len, dtype))
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM)
    out = torch.empty_like(query)
    ones = torch.ones(batch, dtype=torch.int32)
    table, lens = layers.page_table, layers.seq_lens

    def fused() -> None:
        k, v, ks, vs = layers.take()
        paged_decode_attention(query, k, v, table, lens, SM_SCALE, ks, vs, out=out)

    def gather_sdpa() -> None:
        k, v, ks, vs = layers.take()
        paged_prefill_attention(query, k, v, table, lens, ones, SM_SCALE, ks, vs)

    def reference() -> None:
        k, v, ks, vs = layers.take()
        paged_attention_reference(query, k, v, table, lens, ones, SM_SCALE, ks, vs)

    t_fused = Timing(fused, reps)
    t_sdpa = Timing(gather_sdpa, max(3, reps // 4))
    t_ref = Timing(reference, max(3, reps // 4))
    kv_bytes = 2 * batch * seq_len * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
    return (
        f"decode  B={batch:<3d} T={seq_len:<5d} {dtype_name:5s} fused {t_fused} "
        f"{kv_bytes / t_fused.median / 1e6:5.1f} GB/s | gather+SDPA {t_sdpa} | "
        f"reference {t_ref} | SDPA/fused x{t_sdpa.median / t_fused.median:4.1f}"
    )


def _per_sequence_sdpa(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    sm_scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    """The alternative prefill design: one SDPA call per sequence, is_causal=True when the whole
    sequence is new (no cached context), otherwise the batched path for that one sequence."""
    outs, start = [], 0
    for i in range(page_table.shape[0]):
        q_len, seq_len = int(query_lens[i]), int(seq_lens[i])
        rows = query[start : start + q_len]
        row_args = (page_table[i : i + 1], seq_lens[i : i + 1], query_lens[i : i + 1])
        if q_len == seq_len:
            pages = page_table[i, : math.ceil(seq_len / PAGE_SIZE)].long()
            kv = []
            for cache, scale in ((k_cache, k_scale), (v_cache, v_scale)):
                dense = cache[pages].to(torch.float32)
                if scale is not None:
                    dense *= scale[pages].unsqueeze(-1) if scale.dim() else scale
                kv.append(
                    dense.permute(1, 0, 2, 3).reshape(NUM_KV_HEADS, -1, HEAD_DIM)[:, :seq_len]
                )
            out = F.scaled_dot_product_attention(
                rows.transpose(0, 1), kv[0], kv[1], is_causal=True, scale=sm_scale, enable_gqa=True
            ).transpose(0, 1)
        else:
            out = paged_prefill_attention(
                rows, k_cache, v_cache, *row_args, sm_scale, k_scale, v_scale
            )
        outs.append(out)
        start += q_len
    return torch.cat(outs)


def bench_prefill(batch: int, q_len: int, context: int, dtype_name: str, reps: int) -> str:
    dtype = DTYPES[dtype_name]
    seq_len = context + q_len
    layers = Layers(batch, seq_len, dtype, Layers.copies_for(batch, seq_len, dtype))
    query = torch.randn(batch * q_len, NUM_HEADS, HEAD_DIM)
    q_lens = torch.full((batch,), q_len, dtype=torch.int32)
    table, lens = layers.page_table, layers.seq_lens

    def batched() -> None:
        k, v, ks, vs = layers.take()
        paged_prefill_attention(query, k, v, table, lens, q_lens, SM_SCALE, ks, vs)

    def per_sequence() -> None:
        k, v, ks, vs = layers.take()
        _per_sequence_sdpa(query, k, v, table, lens, q_lens, SM_SCALE, ks, vs)

    t_batched = Timing(batched, reps)
    t_per_seq = Timing(per_sequence, reps)
    shape = f"{batch} x {q_len}" + (f" (+{context} ctx)" if context else "")
    return (
        f"prefill {shape:19s} {dtype_name:5s} batched masked SDPA {t_batched} | "
        f"per-sequence SDPA {t_per_seq}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20, help="timed runs per case (median)")
    parser.add_argument("--threads", type=int, default=0, help="torch + numba threads (0: keep)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        numba.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__} threads={torch.get_num_threads()}  numba {numba.__version__} "
        f"threads={numba.get_num_threads()}.  Times in ms: median (best) of the timed runs."
    )
    for batch, seq_len in ((1, 4096), (32, 1024)):
        for dtype_name in DTYPES:
            print(bench_decode(batch, seq_len, dtype_name, args.reps), flush=True)
    for batch, q_len, context in ((1, 512, 0), (4, 256, 0), (1, 512, 1536)):
        for dtype_name in DTYPES:
            print(bench_prefill(batch, q_len, context, dtype_name, args.reps), flush=True)
    print(f"(numba threading layer in use: {numba.threading_layer()})")


if __name__ == "__main__":
    main()
