"""The CPU sparse MLA decode kernel (densa.kernels.cpu.sparse_latent_decode) against the torch
reference (gather the selected latent rows, one SDPA): every KV format latent pages come in,
shuffled pages, selections with holes (-1), and enough rows that a sequence is split in shares
whose softmaxes are merged."""

from __future__ import annotations

import pytest
import torch

from densa.formats.kv_format import KVFormat
from densa.kernels.cpu.kv_store import store_kv
from densa.model.attention import build_group
from densa.model.kv_layout import LatentKVCache
from densa.model.latent_attention import sparse_absorbed_decode

R, ROPE, HEADS, PAGE = 32, 8, 6, 4
SEQ_LENS = [300, 9, 150]


def _latent_cache(kv_dtype: str, num_pages: int) -> LatentKVCache:
    fmt = KVFormat.of(kv_dtype, "dynamic")
    latent = torch.zeros(num_pages, 1, PAGE, R + ROPE, dtype=fmt.storage_dtype)
    scale_dtype = fmt.row_scale_dtype
    scale = None if scale_dtype is None else torch.zeros(num_pages, 1, PAGE, dtype=scale_dtype)
    return LatentKVCache(latent, scale, fmt)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "fp8_e4m3", "int8"])
@torch.inference_mode()
def test_sparse_kernel_equals_the_torch_reference(kv_dtype: str) -> None:
    gen = torch.Generator().manual_seed(3)
    pages_needed = [-(-n // PAGE) for n in SEQ_LENS]
    order = torch.randperm(sum(pages_needed), generator=gen).tolist()  # shuffled pages
    tables, start = [], 0
    for count in pages_needed:
        tables.append(order[start : start + count])
        start += count
    cache = _latent_cache(kv_dtype, sum(pages_needed))
    slots = [(t[p // PAGE], p % PAGE) for t, n in zip(tables, SEQ_LENS, strict=True)
             for p in range(n)]  # fmt: skip
    rows = torch.randn(len(slots), 1, R + ROPE, generator=gen) * 2
    store_kv(cache.kv_format, cache.latent, cache.scale, torch.tensor([s[0] for s in slots]),
             torch.tensor([s[1] for s in slots]), rows)  # fmt: skip
    k = 200  # shares of >= 64 rows: the longest sequence is split
    positions = torch.full((len(SEQ_LENS), k), -1, dtype=torch.long)
    for b, n in enumerate(SEQ_LENS):
        chosen = torch.randperm(n, generator=gen)[: min(k, n)]
        positions[b, : len(chosen)] = chosen
    group = build_group(0, tables, SEQ_LENS, [1] * len(SEQ_LENS), PAGE, torch.device("cpu"))
    q = torch.randn(len(SEQ_LENS), HEADS, R + ROPE, generator=gen)
    scale = 0.11
    ours = sparse_absorbed_decode(q, cache, group, positions, scale, R, "cpu")
    reference = sparse_absorbed_decode(q, cache, group, positions, scale, R, "torch")
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=2e-5)
    # One sequence alone: its 200 rows are cut in shares (one per thread), merged after.
    alone = build_group(0, tables[:1], SEQ_LENS[:1], [1], PAGE, torch.device("cpu"))
    ours = sparse_absorbed_decode(q[:1], cache, alone, positions[:1], scale, R, "cpu")
    torch.testing.assert_close(ours, reference[:1], atol=2e-5, rtol=2e-5)
