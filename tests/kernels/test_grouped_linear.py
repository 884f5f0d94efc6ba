"""Grouped expert matmuls against the per-segment torch reference: the streaming kernel (few rows
per expert) and the GEMM path (many), skipped experts, and the (token, expert) sort."""

from __future__ import annotations

import pytest
import torch

from densa.kernels.cpu.grouped_linear import (
    ExpertSegments,
    can_stream,
    grouped_linear,
    grouped_linear_ref,
    sort_by_expert,
)


def test_segments_skip_experts_without_rows() -> None:
    segments = ExpertSegments.from_counts([2, 0, 0, 3, 1])
    assert segments.experts == [0, 3, 4] and segments.bounds == [0, 2, 5, 6]
    assert list(segments) == [(0, 0, 2), (3, 2, 5), (4, 5, 6)]
    assert segments.max_rows == 3 and segments.num_rows == 6


def test_sort_by_expert_groups_pairs_and_keeps_choice_order() -> None:
    expert_ids = torch.tensor([[2, 0], [0, 2], [1, 2]])  # 3 tokens, top-2
    order, token_of_row, segments = sort_by_expert(expert_ids, num_experts=4)
    assert order.tolist() == [1, 2, 4, 0, 3, 5]  # pairs of expert 0, then 1, then 2
    assert token_of_row.tolist() == [0, 1, 2, 0, 1, 2]
    assert list(segments) == [(0, 0, 2), (1, 2, 3), (2, 3, 6)]


@pytest.mark.parametrize("rows_per_expert", [1, 3, 8, 40])
def test_grouped_linear_matches_reference(rows_per_expert: int) -> None:
    torch.manual_seed(0)
    weight = torch.randn(6, 48, 40)  # [experts, out, in]
    counts = [rows_per_expert, 0, rows_per_expert + 1 if rows_per_expert < 8 else 5, 0, 2, 1]
    segments = ExpertSegments.from_counts(counts)
    x = torch.randn(segments.num_rows, 40)
    assert can_stream(x, weight, segments) == (segments.max_rows <= 8)
    torch.testing.assert_close(
        grouped_linear(x, weight, segments), grouped_linear_ref(x, weight, segments)
    )


def test_grouped_linear_with_no_rows() -> None:
    out = grouped_linear(
        torch.empty(0, 8), torch.randn(2, 4, 8), ExpertSegments.from_counts([0, 0])
    )
    assert out.shape == (0, 4)


@pytest.mark.parametrize("rows_per_expert", [2, 20])  # streaming kernel, GEMM per expert
def test_inactive_experts_weights_are_never_read(rows_per_expert: int) -> None:
    torch.manual_seed(0)
    weight = torch.randn(5, 32, 16)
    weight[[1, 3]] = float("nan")  # experts no row is routed to
    segments = ExpertSegments.from_counts([rows_per_expert, 0, 3, 0, 1])
    x = torch.randn(segments.num_rows, 16)
    out = grouped_linear(x, weight, segments)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, grouped_linear_ref(x, weight, segments))
