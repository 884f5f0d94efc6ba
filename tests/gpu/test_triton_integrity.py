"""The one-kernel integrity check against plain indexing, and the GPU checker built on it."""

from __future__ import annotations

import torch

from densa.kernels.triton.integrity import check_tags


def test_check_counts_and_flags_exactly_the_mismatches() -> None:
    tags = torch.arange(3000, dtype=torch.int64) + 5 * 3000  # generation 5 of every page
    gen = torch.Generator().manual_seed(0)
    pages = torch.randint(0, 3000, (2500,), generator=gen)  # > 2 blocks of pairs
    expected = tags[pages].clone()
    expected[[7, 1500, 2499]] -= 3000  # stale: issued one generation ago
    count, flags = check_tags(tags, torch.stack([pages, expected]))
    assert count == 3
    assert flags.nonzero().flatten().tolist() == [7, 1500, 2499]


def test_check_of_no_pairs_finds_nothing() -> None:
    count, flags = check_tags(torch.arange(4), torch.empty(2, 0, dtype=torch.int64))
    assert count == 0 and flags.numel() == 0
