"""The batched KV-page integrity check in torch: one gather, one compare, one sync (the Triton
kernel, kernels/triton/integrity.py, does the same in one launch)."""

from __future__ import annotations

import torch


def mismatching_rows(tags: torch.Tensor, page_ids: list[int], expected: list[int]) -> list[int]:
    """Rows i with tags[page_ids[i]] != expected[i] (tags: int64 [num_pages], the tag table)."""
    found = tags[torch.tensor(page_ids, dtype=torch.int64, device=tags.device)]
    mismatch = found != torch.tensor(expected, dtype=torch.int64, device=tags.device)
    if not bool(mismatch.any()):
        return []
    return mismatch.nonzero().flatten().tolist()
