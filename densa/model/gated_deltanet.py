"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5, over state slots.

A layer keeps, per request, a fixed-size state instead of K/V pages (densa.kernels.gated_delta
has the math):

    conv    [num_slots, conv_dim, conv_kernel - 1]   the last inputs of the causal short conv
    state   [num_slots, Hv, Dk, Dv] float32          the delta rule's recurrent state

The step's metadata names each request's slot (`AttentionMetadata.state_slot_ids`, decodes then
prefills, like the rows). A prefill chunk that starts a prompt (no context before it) starts from
zeros; any other chunk continues its slot's state, so a prompt split across engine steps gives
the state one pass would. Decodes run one batched step over their slots; prefill chunks run the
chunked form one request at a time (their states are separate recurrences).

The forward, per token: in_proj_qkvz -> q, k, v, z (grouped per key head in the checkpoint);
in_proj_ba -> beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias); q|k|v through the
conv + SiLU; q, k l2-normalized (q also scaled by Dk ** -0.5); the delta rule; a gated RMSNorm
per value head, norm(o) * silu(z); out_proj.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from densa.kernels.cpu.delta_rule import delta_rule_decode
from densa.kernels.gated_delta import (
    causal_conv,
    chunked_delta_rule,
    l2_normalize,
)
from densa.model.attention import AttentionMetadata
from densa.model.family_config import LinearAttentionConfig
from densa.model.linear import Linear


@dataclass
class LinearStateCache:
    """One Gated DeltaNet layer's state slots. conv: [num_slots, conv_dim, conv_kernel - 1] in
    the compute dtype; recurrent: [num_slots, Hv, Dk, Dv] float32 (the recurrence accumulates)."""

    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass(frozen=True)
class PrefillRun:
    """One request's prefill chunk: rows [start, end) of the step, its slot, and whether the
    chunk starts the prompt (its state then starts from zeros, whatever the slot held)."""

    start: int
    end: int
    slot: int
    is_fresh: bool


@dataclass(frozen=True)
class StateBatch:
    """Which slot each of a step's requests reads and writes; built once per step."""

    decode_rows: slice
    decode_slots: torch.Tensor  # [num_decodes] int64
    prefills: tuple[PrefillRun, ...]

    @classmethod
    def of(cls, meta: AttentionMetadata) -> StateBatch:
        if meta.state_slot_ids is None:
            raise ValueError("a hybrid model's step needs state_slot_ids in its metadata")
        slots = meta.state_slot_ids.tolist()
        num_decodes = 0 if meta.decode is None else meta.decode.num_seqs
        decode_rows = slice(0, 0) if meta.decode is None else slice(0, meta.decode.end)
        prefills: list[PrefillRun] = []
        if meta.prefill is not None:
            row = meta.prefill.start
            query_lens = meta.prefill.query_lens.tolist()
            seq_lens = meta.prefill.seq_lens.tolist()
            for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
                slot = slots[num_decodes + i]
                prefills.append(PrefillRun(row, row + q_len, slot, seq_len == q_len))
                row += q_len
        decode_slots = meta.state_slot_ids[:num_decodes].to(torch.int64)
        return cls(decode_rows, decode_slots, tuple(prefills))


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output, then times silu(z) (both in float32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x.to(dtype)) * F.silu(gate.float())


class ShortConv(nn.Module):
    """The depthwise causal conv's weight, [channels, 1, kernel] as nn.Conv1d stores it (the
    checkpoint's name and shape); run by densa.kernels.gated_delta.causal_conv."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, cfg: LinearAttentionConfig, eps: float) -> None:
        super().__init__()
        self.cfg = cfg
        self.heads_per_key = cfg.num_value_heads // cfg.num_key_heads
        self.in_proj_qkvz = Linear(hidden_size, 2 * cfg.key_dim + 2 * cfg.value_dim, bias=False)
        self.in_proj_ba = Linear(hidden_size, 2 * cfg.num_value_heads, bias=False)
        self.conv1d = ShortConv(cfg.conv_dim, cfg.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(cfg.num_value_heads))
        self.A_log = nn.Parameter(torch.empty(cfg.num_value_heads))
        self.norm = GatedRMSNorm(cfg.value_head_dim, eps)
        self.out_proj = Linear(cfg.value_dim, hidden_size, bias=False)

    def split_projections(
        self, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] -> q|k|v [T, conv_dim] (the conv's input), z [T, Hv, Dv],
        b, a [T, Hv]. The checkpoint groups each key head's q, k, v, z (and b, a) together."""
        cfg, r, num_tokens = self.cfg, self.heads_per_key, hidden.shape[0]
        qkvz = self.in_proj_qkvz(hidden).view(num_tokens, cfg.num_key_heads, -1)
        q, k, v, z = qkvz.split(
            [cfg.key_head_dim, cfg.key_head_dim, r * cfg.value_head_dim, r * cfg.value_head_dim],
            dim=-1,
        )  # each [T, Hk, ...]
        ba = self.in_proj_ba(hidden).view(num_tokens, cfg.num_key_heads, 2 * r)
        b, a = (x.reshape(num_tokens, cfg.num_value_heads) for x in ba.split([r, r], dim=-1))
        mixed = torch.cat([x.reshape(num_tokens, -1) for x in (q, k, v)], dim=-1)
        return mixed, z.reshape(num_tokens, cfg.num_value_heads, -1), b, a

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """beta = sigmoid(b); log decay g = -exp(A_log) * softplus(a + dt_bias) ([T, Hv] each)."""
        log_decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return b.float().sigmoid(), log_decay

    def heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [T, conv_dim] -> q, k [T, Hv, Dk] (normalized, q scaled, shared
        across each key head's value heads), v [T, Hv, Dv]."""
        cfg, num_tokens = self.cfg, mixed.shape[0]
        q, k, v = mixed.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        q, k = (
            l2_normalize(
                x.float().view(num_tokens, cfg.num_key_heads, cfg.key_head_dim)
            ).repeat_interleave(self.heads_per_key, dim=1)
            for x in (q, k)
        )  # [T, Hv, Dk]
        return q * cfg.key_head_dim**-0.5, k, v.view(num_tokens, cfg.num_value_heads, -1)

    def forward(
        self, hidden: torch.Tensor, cache: LinearStateCache, batch: StateBatch
    ) -> torch.Tensor:
        mixed, z, b, a = self.split_projections(hidden)
        beta, log_decay = self.gates(b, a)
        shape = (hidden.shape[0], self.cfg.num_value_heads, self.cfg.value_head_dim)
        out = torch.empty(shape, device=hidden.device)  # float32, as the recurrence returns
        if batch.decode_slots.numel():
            rows = batch.decode_rows
            out[rows] = self.decode(mixed[rows], beta[rows], log_decay[rows], cache, batch)
        for run in batch.prefills:
            rows = slice(run.start, run.end)
            out[rows] = self.prefill(mixed[rows], beta[rows], log_decay[rows], cache, run)
        normed = self.norm(out.to(hidden.dtype), z)  # [T, Hv, Dv]
        return self.out_proj(normed.to(hidden.dtype).reshape(hidden.shape[0], -1))

    def decode(
        self,
        mixed: torch.Tensor,
        beta: torch.Tensor,
        log_decay: torch.Tensor,
        cache: LinearStateCache,
        batch: StateBatch,
    ) -> torch.Tensor:
        """One token per request: [B, conv_dim] -> [B, Hv, Dv]."""
        slots = batch.decode_slots
        window = cache.conv.index_select(0, slots)  # [B, conv_dim, K-1]
        conv_out = causal_conv(mixed.unsqueeze(-1), window, self.conv1d.weight[:, 0])
        cache.conv.index_copy_(0, slots, window)
        q, k, v = self.heads(conv_out[..., 0])
        return delta_rule_decode(cache.recurrent, slots, q, k, v, log_decay, beta)

    def prefill(
        self,
        mixed: torch.Tensor,
        beta: torch.Tensor,
        log_decay: torch.Tensor,
        cache: LinearStateCache,
        run: PrefillRun,
    ) -> torch.Tensor:
        """One request's chunk: [T, conv_dim] -> [T, Hv, Dv], its slot's state carried on."""
        if run.is_fresh:
            cache.conv[run.slot].zero_()
            cache.recurrent[run.slot].zero_()
        window = cache.conv[run.slot : run.slot + 1]  # a view: updated in place
        conv_out = causal_conv(mixed.t().unsqueeze(0), window, self.conv1d.weight[:, 0])
        q, k, v = self.heads(conv_out[0].t())  # [T, Hv, D]
        return chunked_delta_rule(q, k, v, log_decay, beta, cache.recurrent[run.slot])


class SplitGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's layout of the same layer: q|k|v (already the conv's channel order), z, b and a
    each from their own projection instead of Qwen3-Next's two per-key-head grouped ones."""

    def __init__(self, hidden_size: int, cfg: LinearAttentionConfig, eps: float) -> None:
        super().__init__(hidden_size, cfg, eps)
        del self.in_proj_qkvz, self.in_proj_ba
        self.in_proj_qkv = Linear(hidden_size, cfg.conv_dim, bias=False)
        self.in_proj_z = Linear(hidden_size, cfg.value_dim, bias=False)
        self.in_proj_b = Linear(hidden_size, cfg.num_value_heads, bias=False)
        self.in_proj_a = Linear(hidden_size, cfg.num_value_heads, bias=False)

    def split_projections(
        self, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        z = self.in_proj_z(hidden).view(hidden.shape[0], self.cfg.num_value_heads, -1)
        return self.in_proj_qkv(hidden), z, self.in_proj_b(hidden), self.in_proj_a(hidden)
