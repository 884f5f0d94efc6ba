"""Grouped expert matmuls for mixture-of-experts layers: rows sorted by expert, one matmul per
active expert over its rows, never a loop over tokens.

A step's (token, expert) pairs are sorted by expert, so each active expert owns one contiguous
run of rows ("segment"); only those experts' weights are read:

    sorted rows   [ e1 e1 e1 | e4 | e5 e5 | ... ]       weight [E, out, in]  (stacked experts)
    segments       (1, 0..3)  (4, 3..4) (5, 4..6)       out[rows of e] = x[rows of e] @ W[e]^T

Large segments (prefill) go through torch's GEMM, one call per active expert. Small ones
(decode: a few rows per expert) go through one fused streaming kernel that walks every active
expert's weight rows once, in parallel across experts and row blocks -- the MoE counterpart of
`cpu_linear`, and the reason decode cost scales with the *active* experts' bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

MAX_STREAMING_ROWS = 8  # rows per expert up to which streaming beats GEMM (as in cpu_linear)


@dataclass(frozen=True)
class ExpertSegments:
    """Which experts own which sorted rows: expert experts[i] owns rows bounds[i]:bounds[i + 1]."""

    experts: list[int]  # active expert ids, ascending
    bounds: list[int]  # len(experts) + 1 row offsets, starting at 0

    @classmethod
    def from_counts(cls, counts: list[int]) -> ExpertSegments:
        """counts[e] = rows routed to expert e (experts with none are skipped)."""
        experts = [e for e, n in enumerate(counts) if n]
        bounds = [0]
        for e in experts:
            bounds.append(bounds[-1] + counts[e])
        return cls(experts, bounds)

    @property
    def num_rows(self) -> int:
        return self.bounds[-1]

    @property
    def max_rows(self) -> int:
        return max((b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False)), default=0)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        """(expert, first row, end row) per active expert."""
        return iter(zip(self.experts, self.bounds, self.bounds[1:], strict=False))


def sort_by_expert(
    expert_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, ExpertSegments]:
    """expert_ids [T, k] -> (order [T*k]: pair index of each sorted row, token of each sorted
    row [T*k], the segments). Pair p = token p // k, choice p % k."""
    flat = expert_ids.reshape(-1)  # [T * k]
    order = torch.argsort(flat, stable=True)  # stable: a token's rows stay in choice order
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, order // expert_ids.shape[1], ExpertSegments.from_counts(counts)


def grouped_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, segments: ExpertSegments
) -> torch.Tensor:
    """Obviously correct: x [N, in] (sorted rows), weight [E, out, in] -> [N, out]."""
    out = x.new_zeros(x.shape[0], weight.shape[1])
    for expert, start, end in segments:
        out[start:end] = F.linear(x[start:end], weight[expert].to(x.dtype))
    return out


def can_stream(x: torch.Tensor, weight: torch.Tensor, segments: ExpertSegments) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and segments.max_rows <= MAX_STREAMING_ROWS
    )


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, segments: ExpertSegments) -> torch.Tensor:
    """x [N, in] sorted by expert, weight [E, out, in] -> [N, out]; reads active experts only."""
    if segments.num_rows == 0:
        return x.new_zeros(0, weight.shape[1])
    if can_stream(x, weight, segments):
        from densa.kernels.cpu import streaming_matmul as kernels  # imports Numba: on first use

        out = torch.empty(x.shape[0], weight.shape[1], dtype=torch.float32)
        kernels.grouped_streaming_matmul(
            weight.detach().numpy(),
            x.contiguous().numpy(),
            np.asarray(segments.experts, dtype=np.int64),
            np.asarray(segments.bounds, dtype=np.int64),
            out.numpy(),
        )
        return out
    out = torch.empty(x.shape[0], weight.shape[1], dtype=x.dtype, device=x.device)
    for expert, start, end in segments:
        out[start:end] = F.linear(x[start:end], weight[expert])
    return out
