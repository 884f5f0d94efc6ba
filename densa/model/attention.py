"""Paged attention: where K/V pages live, what a step's attention needs to know, and the backends.

A step's tokens are one flattened batch, decode tokens first:

    rows:   [ d0 d1 ... d(nd-1) | p0 p0 p0 p1 p1 ... ]
              one row per decode   prefill chunks, request by request
              request (q_len 1)    (q_len >= 1, earlier context already in pages)

Each group is attended as a batch padded to its longest query and context, so there is no Python
loop over requests per layer. Backends implement the two groups; `paged_attention` stores the new
K/V first (every layer writes before it reads) and dispatches.

FP8 / INT8 pages: prefill chunks attend to their own tokens' K/V in high precision (as computed)
and to earlier context from the quantized pages; decode reads everything from the pages. So
quantization error does not compound through a prompt's layers, and every later step reads the
same stored values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from densa.formats.kv_format import DYNAMIC, NO_SCALES, ROW, STATIC, KVFormat, is_layer_scale
from densa.kernels.cpu.kv_store import store_kv
from densa.kernels.cpu.prefill_attention import paged_prefill_attention
from densa.kernels.reference.paged_attention import scale_to_float


@dataclass
class LayerKVCache:
    """One layer's pages. k, v: [num_pages, num_kv_heads, page_size, head_dim].

    For FP8 caches, values are stored scaled: real = stored * scale, with scales either one per
    layer (0-dim float32, static) or one per token and head ([num_pages, num_kv_heads, page_size]
    int8 power-of-two exponents, dynamic); see densa.formats.fp8_kv.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    # How the pages store values. The engine's allocator always passes it; pages made by hand
    # (tests, kernel benchmarks) get it read off their tensors, once, here.
    kv_format: KVFormat = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.kv_format is None:
            self.kv_format = KVFormat.of_tensors(self.k, self.k_scale)

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


@dataclass(frozen=True)
class AttentionGroup:
    """Requests attended together (all decodes, or all prefill chunks) over rows [start, end)."""

    start: int
    end: int
    page_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32: context length including this step's tokens
    query_lens: torch.Tensor  # [B] int32
    max_query_len: int
    # Padded layout for the torch path, built once per step and shared by every layer:
    valid: torch.Tensor  # [B * max_query_len] bool: which padded query slots are real rows
    mask: torch.Tensor  # [B, 1, max_query_len, max_pages * page_size] bool, True = attend

    @property
    def num_seqs(self) -> int:
        return self.page_table.shape[0]


@dataclass(frozen=True)
class AttentionMetadata:
    slot_pages: torch.Tensor  # [T] int64: page receiving each new token's K/V
    slot_offsets: torch.Tensor  # [T] int64: slot within that page
    decode: AttentionGroup | None
    prefill: AttentionGroup | None
    # Hybrid models: each request's state slot ([num decodes + num prefills] int64, in row
    # order), read and written by the linear-attention layers (densa.model.gated_deltanet)
    state_slot_ids: torch.Tensor | None = None


def build_group(
    start: int,
    page_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    page_size: int,
    device: torch.device,
) -> AttentionGroup:
    """Tensors for one group; page tables are padded with page 0 (masked out, never used)."""
    num_seqs = len(page_tables)
    max_pages = max(len(t) for t in page_tables)
    table = torch.zeros(num_seqs, max_pages, dtype=torch.int32)
    for i, pages in enumerate(page_tables):
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    q_t = torch.tensor(query_lens, dtype=torch.int32)
    max_q = max(query_lens)
    q_idx = torch.arange(max_q)
    valid = (q_idx[None, :] < q_t[:, None]).reshape(-1)
    # Query j of sequence i sits at absolute position seq_len - q_len + j and sees keys <= it.
    q_pos = (seq_t - q_t)[:, None] + q_idx[None, :]  # [B, max_q]
    k_pos = torch.arange(max_pages * page_size)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, max_q, max_k]
    return AttentionGroup(
        start=start,
        end=start + sum(query_lens),
        page_table=table.to(device),
        seq_lens=seq_t.to(device),
        query_lens=q_t.to(device),
        max_query_len=max_q,
        valid=valid.to(device),
        mask=mask.unsqueeze(1).to(device),
    )


# The KV encodings (KVFormat.scales) every backend here reads: unscaled, FP8 with static or
# dynamic scales, INT8 with row scales.
ALL_KV_ENCODINGS = frozenset({NO_SCALES, STATIC, DYNAMIC, ROW})


@dataclass(frozen=True)
class BackendCapabilities:
    """What an attention backend can do, declared by it and asked by whoever wires it."""

    # Decode steps can be captured in CUDA graphs: no host sync, launch grids from shapes only.
    supports_cuda_graphs: bool
    # Decode-only steps may run through the fused C++ step instead (model/fused_decode.py),
    # which attends as this backend does: the CPU backend's kernels are its own.
    fused_decode: bool
    # Brings a one-kernel batched check of the step's page tags (worker/integrity.py).
    batched_tag_check: bool
    # The KV encodings (KVFormat.scales) its kernels read and write.
    kv_encodings: frozenset[str] = ALL_KV_ENCODINGS


class AttentionBackend(Protocol):
    """Computes paged attention for one group. Reads the cache; mutates nothing but `out`."""

    name: str

    @property
    def capabilities(self) -> BackendCapabilities:
        """What it can do (CUDA graphs, the fused decode step, which KV encodings it reads)."""
        ...

    def store_kv(
        self, cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Write this step's K/V ([T, KVH, D]) into their slots (quantizing for narrow caches)."""
        ...

    def attend(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        group: AttentionGroup,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q: [rows of the group, H, D] -> attention output, same shape, q's dtype.

        new_kv: the group's own K/V rows ([rows, KVH, D]) as computed; when given (prefill on
        narrow pages), the group's positions are read from them instead of from the cache.
        """
        ...


def paged_attention(
    backend: AttentionBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KVH, D] -> [T, H, D]: store this step's K/V, then attend."""
    backend.store_kv(cache, k, v, meta)
    return attend_stored(backend, q, k, v, cache, meta, scale)


def attend_stored(
    backend: AttentionBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of a step whose K/V (k, v: [T, KVH, D]) are already in the pages."""
    fresh_prefill = cache.kv_format.is_quantized
    groups = [g for g in (meta.decode, meta.prefill) if g is not None]
    if len(groups) == 1:  # the common case: all decodes or all prefill, no output copy needed
        group = groups[0]
        new_kv = (k, v) if fresh_prefill and group is meta.prefill else None
        return backend.attend(q, cache, group, scale, new_kv)
    out = torch.empty_like(q)
    for group in groups:
        rows = slice(group.start, group.end)
        new_kv = (k[rows], v[rows]) if fresh_prefill and group is meta.prefill else None
        out[rows] = backend.attend(q[rows], cache, group, scale, new_kv)
    return out


class TorchAttentionBackend:
    """Portable reference path: gather pages into a padded batch, then SDPA with a causal mask."""

    name = "torch"
    capabilities = BackendCapabilities(
        supports_cuda_graphs=False, fused_decode=False, batched_tag_check=False
    )

    def store_kv(
        self, cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        fmt = cache.kv_format  # quantizes in high precision for FP8 / INT8 pages
        store_kv(fmt, cache.k, cache.k_scale, meta.slot_pages, meta.slot_offsets, k)
        store_kv(fmt, cache.v, cache.v_scale, meta.slot_pages, meta.slot_offsets, v)

    def attend(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        group: AttentionGroup,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        num_seqs, max_q = group.num_seqs, group.max_query_len
        num_heads, head_dim = q.shape[1], q.shape[2]
        q_pad = q.new_zeros(num_seqs * max_q, num_heads, head_dim)
        q_pad[group.valid] = q
        q_pad = q_pad.view(num_seqs, max_q, num_heads, head_dim).transpose(1, 2)  # [B, H, Q, D]
        fmt, table = cache.kv_format, group.page_table
        k = gather_dequantized(cache.k, cache.k_scale, table, q.dtype, fmt)  # [B, KVH, K, D]
        v = gather_dequantized(cache.v, cache.v_scale, table, q.dtype, fmt)
        if new_kv is not None:  # the group's own positions, unquantized
            seq, pos = query_positions(group)
            k[seq, :, pos] = new_kv[0].to(k.dtype)
            v[seq, :, pos] = new_kv[1].to(v.dtype)
        out = F.scaled_dot_product_attention(
            q_pad, k, v, attn_mask=group.mask, scale=scale, enable_gqa=True
        )  # [B, H, Q, D]
        return out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)[group.valid]


def query_positions(group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, absolute position) of each of the group's rows, in row order."""
    query_lens = group.query_lens.long()
    total = int(query_lens.sum())
    seq = torch.repeat_interleave(torch.arange(group.num_seqs), query_lens, output_size=total)
    starts = torch.cumsum(query_lens, 0) - query_lens
    j = torch.arange(total) - starts[seq]
    return seq, (group.seq_lens.long() - query_lens)[seq] + j


def gather_pages(cache: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """[num_pages, KVH, P, D] gathered by [B, max_pages] -> [B, KVH, max_pages * P, D]."""
    pages = cache[page_table.long()]  # [B, max_pages, KVH, P, D]
    num_seqs, max_pages, num_kv_heads, page_size, head_dim = pages.shape
    return pages.transpose(1, 2).reshape(num_seqs, num_kv_heads, max_pages * page_size, head_dim)


def gather_dequantized(
    cache: torch.Tensor,
    scale: torch.Tensor | None,
    page_table: torch.Tensor,
    dtype: torch.dtype,
    kv_format: KVFormat | None = None,
) -> torch.Tensor:
    """gather_pages, widened to `dtype` and multiplied by the cache's scales (if any)."""
    values = gather_pages(cache, page_table)  # [B, KVH, K, D]
    if scale is None:
        return values.to(dtype)
    if is_layer_scale(scale, kv_format):
        return (values.to(torch.float32) * scale).to(dtype)
    per_token = scale[page_table.long()]  # [B, max_pages, KVH, P]
    num_seqs, _, num_kv_heads, _ = per_token.shape
    per_token = per_token.transpose(1, 2).reshape(num_seqs, num_kv_heads, -1, 1)  # [B,KVH,K,1]
    return (values.to(torch.float32) * scale_to_float(per_token)).to(dtype)


class CpuAttentionBackend(TorchAttentionBackend):
    """Fused Numba kernels: decode reads pages in place (no gather) and widens narrow caches in
    registers; prefill is tiled over pages (flash-style, kernels/cpu/prefill_attention.py)."""

    name = "cpu"
    capabilities = BackendCapabilities(
        supports_cuda_graphs=False, fused_decode=True, batched_tag_check=False
    )

    def attend(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        group: AttentionGroup,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        query = q.float()  # the kernels compute in fp32 whatever the model dtype
        if group.max_query_len == 1:
            # Imports Numba (~55 MiB resident) on the first eager decode step, not at import:
            # with the fused C++ step, decode never comes here.
            from densa.kernels.cpu import paged_attention as kernels

            out = kernels.paged_decode_attention(
                query, cache.k, cache.v, group.page_table, group.seq_lens, scale,
                cache.k_scale, cache.v_scale, kv_format=cache.kv_format,
            )  # fmt: skip
        else:
            out = paged_prefill_attention(
                query, cache.k, cache.v, group.page_table, group.seq_lens, group.query_lens,
                scale, cache.k_scale, cache.v_scale, new_kv, cache.kv_format,
            )  # fmt: skip
        return out.to(q.dtype)
