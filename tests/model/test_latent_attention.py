"""MLA over latent pages: the weight-absorbed decode equals the expanded (decompress, then
multi-head) attention, on the torch path and through the fused CPU kernel, for BF16 and FP8
latent pages with shuffled page tables."""

from __future__ import annotations

import pytest
import torch

from densa.formats import fp8_kv
from densa.model.attention import AttentionMetadata, build_group
from densa.model.kv_layout import LatentKVCache
from densa.model.latent_attention import absorbed_decode, expanded_prefill, store_latent
from densa.model.linear import Linear

R, ROPE, NOPE, V, HEADS, PAGE = 32, 8, 16, 12, 4, 4
SEQ_LENS = [9, 3, 14]


def _cache(dtype: torch.dtype, num_pages: int) -> LatentKVCache:
    latent = torch.zeros(num_pages, 1, PAGE, R + ROPE).to(dtype)
    scale = None
    if dtype == fp8_kv.FP8_DTYPE:
        scale = torch.zeros(num_pages, 1, PAGE, dtype=fp8_kv.EXPONENT_SCALE_DTYPE)
    return LatentKVCache(latent, scale)


def _fill(cache: LatentKVCache, tables: list[list[int]]) -> None:
    """Store random latent rows for every position of every sequence."""
    gen = torch.Generator().manual_seed(1)
    pages, offsets = [], []
    for table, seq_len in zip(tables, SEQ_LENS, strict=True):
        for pos in range(seq_len):
            pages.append(table[pos // PAGE])
            offsets.append(pos % PAGE)
    rows = torch.randn(len(pages), R + ROPE, generator=gen)
    meta = AttentionMetadata(torch.tensor(pages), torch.tensor(offsets), None, None)
    store_latent(cache, rows, meta)


@pytest.mark.parametrize("dtype", [torch.bfloat16, fp8_kv.FP8_DTYPE])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@torch.inference_mode()
def test_absorbed_decode_equals_expanded_attention(dtype: torch.dtype, backend: str) -> None:
    torch.manual_seed(0)
    tables = [[7, 2, 5], [0], [3, 8, 1, 6]]  # shuffled, non-contiguous pages
    cache = _cache(dtype, num_pages=9)
    _fill(cache, tables)
    kv_b_proj = Linear(R, HEADS * (NOPE + V))
    kv_b_proj.weight.data.normal_(0, 0.2)
    q = torch.randn(len(SEQ_LENS), HEADS, NOPE + ROPE)  # the last position of each sequence
    group = build_group(0, tables, SEQ_LENS, [1, 1, 1], PAGE, torch.device("cpu"))
    scale = (NOPE + ROPE) ** -0.5

    expanded = expanded_prefill(q, cache, group, scale, kv_b_proj, (R, NOPE, V))  # [B, H, V]
    weight = kv_b_proj.weight.view(HEADS, NOPE + V, R)
    w_uk, w_uv = weight[:, :NOPE], weight[:, NOPE:]
    q_latent = torch.cat([torch.einsum("bhn,hnr->bhr", q[..., :NOPE], w_uk), q[..., NOPE:]], -1)
    o_latent = absorbed_decode(q_latent, cache, group, scale, R, backend)  # [B, H, R]
    absorbed = torch.einsum("bhr,hvr->bhv", o_latent, w_uv)
    torch.testing.assert_close(absorbed, expanded, atol=1e-4, rtol=1e-4)


def test_fp8_latent_pages_round_trip_within_e4m3_precision() -> None:
    cache = _cache(fp8_kv.FP8_DTYPE, num_pages=4)
    rows = torch.randn(3, R + ROPE) * torch.tensor([0.01, 1.0, 300.0]).unsqueeze(1)
    meta = AttentionMetadata(torch.tensor([2, 2, 0]), torch.tensor([1, 3, 0]), None, None)
    store_latent(cache, rows, meta)
    assert cache.scale is not None
    stored = cache.latent[meta.slot_pages, 0, meta.slot_offsets].float()
    restored = (
        stored * torch.exp2(cache.scale[meta.slot_pages, 0, meta.slot_offsets].float())[:, None]
    )
    # One power-of-two scale per row, whatever its magnitude: e4m3 keeps 3 mantissa bits.
    assert ((restored - rows).abs() <= rows.abs().amax(1, keepdim=True) / 16).all()
