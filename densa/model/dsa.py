"""DeepSeek Sparse Attention (DSA; DeepSeek-V3.2-Exp, GLM-5): the lightning indexer.

For every query the indexer scores each cached token with its own small queries and one small
key per token, and MLA then attends only to the `index_topk` best tokens:

    q_I  = c_q W_qI                      [T, H_I, D_I]   c_q: MLA's normalized query latent
    k_I  = LayerNorm(x W_kI)             [T, D_I]        one key per token, shared by the heads
           RoPE on the first rope_dim values of q_I and k_I (the rest passes through):
           half-split pairs for DeepSeek-V3.2, interleaved for GLM-5
    w    = (x W_w) * H_I^-0.5            [T, H_I]        per-head weights (float32)
    I(t, s) = sum_h  w[t, h] * ReLU(q_I[t, h] . k_I[s] * D_I^-0.5)      for s <= t
    S(t) = top index_topk of I(t, .)     (every earlier token when there are fewer)

k_I is cached like K/V: the index keys of densa.model.kv_layout's sparse layout, in the same
pages as the latents. Quantized pages (FP8: DeepSeek-V3.2's own storage) hold k_I rotated by a
Hadamard transform H (orthonormal, so (q H).(k H) = q.k): it spreads outlying channels over the
block before one scale is chosen for it; the queries get the same rotation when they score.

GLM-5's "shared" layers run no indexer: they attend to the S(t) of the last full layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from densa.kernels.cpu.kv_store import store_kv
from densa.model.arch import ArchConfig
from densa.model.attention import (
    AttentionGroup,
    AttentionMetadata,
    gather_dequantized,
    query_positions,
)
from densa.model.kv_layout import IndexKeyCache
from densa.model.layers import RotaryEmbedding
from densa.model.linear import Linear

CosSin = tuple[torch.Tensor, torch.Tensor]
KEY_NORM_EPS = 1e-6  # the reference indexer's LayerNorm eps, whatever the config's
# Padded scores a prefill group may hold at once ([queries, H_I, keys] float32): 256 MiB.
_MAX_SCORES = 1 << 26


@dataclass(frozen=True)
class Selection:
    """The tokens a step's queries attend to, per attention group (None: the whole context,
    when no context of the group is longer than index_topk).

        decode   [B, k] int64: positions (within each sequence) of the decode rows' chosen
                 tokens, -1 where a context holds fewer than k
        prefill  [B, 1, max_query_len, max_keys] bool: keys each padded prefill query attends
                 (its causal mask and its top-k), the shape of AttentionGroup.mask
    """

    decode: torch.Tensor | None = None
    prefill: torch.Tensor | None = None


class Indexer(nn.Module):
    """One full layer's indexer (its projections named as the checkpoints name them)."""

    def __init__(self, cfg: ArchConfig, rope_interleave: bool) -> None:
        super().__init__()
        if cfg.dsa is None or cfg.mla is None or cfg.mla.q_lora_rank is None:
            raise ValueError(f"{cfg.architecture}'s indexer needs DSA and query-LoRA settings")
        dsa = cfg.dsa
        self.num_heads, self.head_dim, self.topk = dsa.num_heads, dsa.head_dim, dsa.topk
        self.rope_dim = cfg.mla.rope_head_dim
        self.wq_b = Linear(cfg.mla.q_lora_rank, dsa.num_heads * dsa.head_dim)
        self.wk = Linear(cfg.hidden_size, dsa.head_dim)
        self.k_norm = nn.LayerNorm(dsa.head_dim, eps=KEY_NORM_EPS)
        self.weights_proj = Linear(cfg.hidden_size, dsa.num_heads)  # kept high precision
        self.rotate = (
            RotaryEmbedding.rotate_interleaved if rope_interleave else RotaryEmbedding.rotate_heads
        )

    def forward(
        self,
        hidden: torch.Tensor,
        q_latent: torch.Tensor,
        rope: CosSin,
        cache: IndexKeyCache,
        meta: AttentionMetadata,
    ) -> Selection:
        """hidden: [T, hidden], q_latent (c_q): [T, q_lora_rank] -> the step's selection,
        after storing this step's index keys."""
        num_tokens = hidden.shape[0]
        keys = self._rope(self.k_norm(self.wk(hidden)).unsqueeze(1), rope)  # [T, 1, D_I]
        rotated = cache.kv_format.is_quantized
        if rotated:
            keys = hadamard_rotate(keys)
        blocks = keys.view(num_tokens, *cache.keys.shape[1::2])  # [T, blocks, block]
        store_kv(cache.kv_format, cache.keys, cache.scale, meta.slot_pages, meta.slot_offsets,
                 blocks)  # fmt: skip
        queries = self.wq_b(q_latent).view(num_tokens, self.num_heads, self.head_dim)
        queries = self._rope(queries, rope)  # [T, H_I, D_I]
        if rotated:
            queries = hadamard_rotate(queries)
        weights = F.linear(hidden.float(), self.weights_proj.weight.float())  # [T, H_I]
        weights = weights * self.num_heads**-0.5
        fresh = keys[:, 0] if rotated else None  # a prefill scores its own keys as computed
        return Selection(
            decode=self._select(queries, weights, cache, meta.decode, as_positions=True),
            prefill=self._select(queries, weights, cache, meta.prefill, fresh=fresh),
        )

    def _rope(self, x: torch.Tensor, rope: CosSin) -> torch.Tensor:
        """RoPE on the first rope_dim values of each head of x [T, heads, D_I]."""
        rotated = self.rotate(x[..., : self.rope_dim], rope)
        return torch.cat([rotated, x[..., self.rope_dim :]], dim=-1)

    def _select(
        self,
        queries: torch.Tensor,
        weights: torch.Tensor,
        cache: IndexKeyCache,
        group: AttentionGroup | None,
        fresh: torch.Tensor | None = None,
        as_positions: bool = False,
    ) -> torch.Tensor | None:
        """One group's selection, as Selection holds it (positions for decode rows)."""
        if group is None or group.mask.shape[-1] <= self.topk:
            return None  # every context fits in the top-k: attend to all of it
        rows = slice(group.start, group.end)
        keys = gather_index_keys(cache, group)  # [B, K, D_I]
        if fresh is not None:
            seq, pos = query_positions(group)
            keys[seq, pos] = fresh[rows].float()
        scores = index_scores(queries[rows].float(), weights[rows], keys, group)  # [B, Q, K]
        chosen = scores.topk(min(self.topk, scores.shape[-1]), dim=-1)
        if as_positions:  # one query per sequence: the chosen positions, -1 past the context
            return chosen.indices[:, 0].masked_fill(chosen.values[:, 0] == -torch.inf, -1)
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen.indices, True)
        return (keep & group.mask[:, 0]).unsqueeze(1)


def gather_index_keys(cache: IndexKeyCache, group: AttentionGroup) -> torch.Tensor:
    """The group's index keys in float32, padded to whole pages: [B, max_pages * page_size, D_I]."""
    keys = gather_dequantized(
        cache.keys, cache.scale, group.page_table, torch.float32, cache.kv_format
    )  # fmt: skip  -> [B, blocks, K, block]
    num_seqs, num_blocks, num_keys, block = keys.shape
    return keys.transpose(1, 2).reshape(num_seqs, num_keys, num_blocks * block)


def index_scores(
    queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, group: AttentionGroup
) -> torch.Tensor:
    """I(t, s) for the group's rows (queries [rows, H_I, D_I], weights [rows, H_I]) over keys
    [B, K, D_I]: [B, max_query_len, K], -inf where the causal mask hides a key."""
    num_seqs, max_q = group.num_seqs, group.max_query_len
    num_heads, head_dim = queries.shape[1:]
    q_pad = queries.new_zeros(num_seqs * max_q, num_heads, head_dim)
    q_pad[group.valid] = queries
    w_pad = weights.new_zeros(num_seqs * max_q, num_heads)
    w_pad[group.valid] = weights
    q_pad = q_pad.view(num_seqs, max_q, num_heads, head_dim)
    w_pad = w_pad.view(num_seqs, max_q, 1, num_heads)
    keys_t = keys.transpose(1, 2).unsqueeze(1)  # [B, 1, D_I, K]
    scores = keys.new_empty(num_seqs, max_q, keys.shape[1])
    step = max(1, _MAX_SCORES // max(1, num_heads * keys.shape[1] * num_seqs))
    for lo in range(0, max_q, step):  # bounded [B, step, H_I, K] scores at a time
        hi = min(lo + step, max_q)
        per_head = F.relu(torch.matmul(q_pad[:, lo:hi], keys_t) * head_dim**-0.5)
        scores[:, lo:hi] = torch.matmul(w_pad[:, lo:hi], per_head).squeeze(-2)
    return scores.masked_fill(~group.mask[:, 0], -torch.inf)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] times the orthonormal Hadamard matrix of size D (a power of two); other
    widths are returned as they are (no such matrix), which keeps scores exact either way."""
    size = x.shape[-1]
    if size & (size - 1):
        return x
    return x @ _hadamard(size, x.dtype, x.device)


@functools.cache
def _hadamard(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < size:  # Sylvester: H_2n = [[H, H], [H, -H]]
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return (matrix * size**-0.5).to(dtype=dtype, device=device)
