"""Chunked-prefill attention on the CPU, tiled over pages: each (sequence, kv head, tile of query
rows) walks its context in key blocks with an online softmax (flash attention), so memory is
bounded by the tile, not by chunk x context. At 32k tokens the one masked SDPA call that ran
before gathered and widened the whole context per layer, and scored [heads, chunk, context] at
once (~800 MB for the 1.5B's 512-token chunks).

Two implementations of one computation:
- densa's C++ kernel (`csrc/prefill_attention.cpp`, AVX-512 and AVX2 paths): widens each key
  block of any KV format in registers, register-tiled scores and values, and reduces every row
  in an order fixed by its own position, so a row computes the same bits whatever chunk, tile
  or batch it is in (docs/architecture.md, "Batch invariance");
- a torch fallback for what the kernel does not read (float16 pages, FP8 with float32 scales,
  head dims not a multiple of 4) or where it is not built: the same tiling in torch ops.
Layout, scales and GQA follow `paged_attention_reference`, which both are tested against.
"""

from __future__ import annotations

import torch

from densa.formats.fp8_kv import EXPONENT_SCALE_DTYPE
from densa.formats.kv_format import KVFormat
from densa.kernels.cpu import native
from densa.kernels.reference.paged_attention import dequantize_pages

# Keys per block of the torch fallback: its scores are [heads, query rows, KEY_BLOCK] at most.
KEY_BLOCK = 1024
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8)
# Query heads per kv head the C++ tiles hold for one row (6 vectors of 8 lanes on AVX2; AVX-512
# holds 96): a larger group (multi-query attention with many heads) takes the torch path.
MAX_NATIVE_GROUP = 48


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_format: KVFormat | None = None,
) -> torch.Tensor:
    """Causal attention for chunked prefill (any query_len >= 1).

    query: float32 [total_q, H, D], sequence i owning query_lens[i] consecutive rows whose
    absolute positions are seq_lens[i] - query_lens[i] + j. Returns float32 [total_q, H, D].
    new_kv: optional (k, v) [total_q, Hkv, D] of the query rows before they were quantized into
    the cache; attention then reads them instead of their cached copies (see the reference).
    `kv_format` is accepted for the backends' common signature; the scales' own dtype and shape
    say how to read them.
    """
    del kv_format
    if _native_reads(query, k_cache, k_scale) and _native_reads(query, v_cache, v_scale):
        ext = native.load()
        assert ext is not None
        new_k, new_v = (None, None) if new_kv is None else _fresh(new_kv)
        out: torch.Tensor = ext.prefill_attention(
            query.float().contiguous(), k_cache, k_scale, v_cache, v_scale,
            page_table.int().contiguous(), seq_lens.int().contiguous(),
            query_lens.int().contiguous(), float(sm_scale), new_k, new_v, native.fp8_table(),
            native.isa(),
        )  # fmt: skip
        return out
    return tiled_prefill_attention(
        query, k_cache, v_cache, page_table, seq_lens, query_lens, sm_scale,
        k_scale, v_scale, new_kv,
    )  # fmt: skip


def _native_reads(query: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether the C++ kernel reads these pages: its KV formats, as the engine stores them."""
    if cache.dtype not in _NATIVE_DTYPES or not cache.is_contiguous() or query.shape[-1] % 4:
        return False
    if query.shape[1] // cache.shape[1] > MAX_NATIVE_GROUP:
        return False
    if cache.device.type != "cpu" or not native.is_available():
        return False
    if cache.dtype == torch.int8:  # one fp16 scale per row
        return scale is not None and scale.dtype == torch.float16 and scale.is_contiguous()
    if scale is None:
        return True
    if cache.dtype != torch.float8_e4m3fn:
        return False
    return scale.dim() == 0 or (scale.dtype == EXPONENT_SCALE_DTYPE and scale.is_contiguous())


def _fresh(new_kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return new_kv[0].float().contiguous(), new_kv[1].float().contiguous()


def tiled_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The torch fallback: per sequence, key blocks of KEY_BLOCK positions with an online
    softmax. Same arguments and result as `paged_prefill_attention`."""
    out = torch.empty(query.shape, dtype=torch.float32)
    first = 0
    for b, (seq_len, q_len) in enumerate(zip(seq_lens.tolist(), query_lens.tolist(), strict=True)):
        rows = slice(first, first + q_len)
        fresh = None if new_kv is None else (new_kv[0][rows], new_kv[1][rows])
        out[rows] = _sequence_attention(
            query[rows].float(), k_cache, v_cache, page_table[b].long(), seq_len,
            sm_scale, k_scale, v_scale, fresh,
        )  # fmt: skip
        first += q_len
    return out


def _sequence_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_row: torch.Tensor,
    seq_len: int,
    sm_scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    fresh: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """One sequence's rows q [Q, H, D] over its first seq_len positions -> [Q, H, D]."""
    q_len, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    start = seq_len - q_len
    # [Hkv, G * Q, D]: the query heads of one kv head, row-major by (g, row).
    qg = (q * sm_scale).permute(1, 0, 2).reshape(num_kv_heads, group * q_len, head_dim)
    q_pos = (start + torch.arange(q_len)).repeat(group)  # [G * Q]
    run_max = torch.full((num_kv_heads, group * q_len, 1), float("-inf"))
    run_sum = torch.zeros(num_kv_heads, group * q_len, 1)
    acc = torch.zeros(num_kv_heads, group * q_len, head_dim)
    for k0 in range(0, seq_len, KEY_BLOCK):
        k1 = min(seq_len, k0 + KEY_BLOCK)
        k = _block(k_cache, k_scale, page_row, k0, k1, page_size, start, fresh, 0)
        v = _block(v_cache, v_scale, page_row, k0, k1, page_size, start, fresh, 1)
        scores = qg @ k.transpose(1, 2)  # [Hkv, G * Q, n]
        future = torch.arange(k0, k1).view(1, -1) > q_pos.view(-1, 1)
        scores.masked_fill_(future, float("-inf"))
        new_max = torch.maximum(run_max, scores.amax(-1, keepdim=True))
        alpha = torch.exp(run_max - new_max)
        probs = torch.exp(scores - new_max)
        run_sum = run_sum * alpha + probs.sum(-1, keepdim=True)
        acc = acc * alpha + probs @ v
        run_max = new_max
    out = (acc / run_sum).reshape(num_heads, q_len, head_dim)
    return out.permute(1, 0, 2)


def _block(
    cache: torch.Tensor,
    scale: torch.Tensor | None,
    page_row: torch.Tensor,
    k0: int,
    k1: int,
    page_size: int,
    fresh_from: int,
    fresh: tuple[torch.Tensor, torch.Tensor] | None,
    side: int,
) -> torch.Tensor:
    """Positions [k0, k1) of one sequence widened to float32 [Hkv, k1 - k0, D]; positions
    >= fresh_from read from the chunk's own K/V (side 0: K, 1: V) when given."""
    first_page, last_page = k0 // page_size, (k1 - 1) // page_size
    pages = page_row[first_page : last_page + 1]
    values = dequantize_pages(cache, pages, scale)  # [n_pages, Hkv, S, D]
    num_kv_heads, head_dim = values.shape[1], values.shape[3]
    values = values.transpose(0, 1).reshape(num_kv_heads, -1, head_dim)
    offset = first_page * page_size
    values = values[:, k0 - offset : k1 - offset]
    if fresh is not None and k1 > fresh_from:
        lo = max(k0, fresh_from)
        values = values.clone()
        values[:, lo - k0 :] = (
            fresh[side][lo - fresh_from : k1 - fresh_from].float().transpose(0, 1)
        )
    return values
