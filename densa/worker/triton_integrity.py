"""The tag-table checker with its batched comparison as one Triton kernel (GPU tag tables).

The step's (page, expected tag) pairs go to the device in one copy, one kernel compares and
counts (densa.kernels.triton_integrity), and one 4-byte read-back says whether anything
mismatched: against a gather, a compare, an any() and their syncs in torch. Everything else
(the tag table itself, updates, violation reports) is TagTableChecker's.
"""

from __future__ import annotations

import torch

from densa.worker.integrity import TagTableChecker


class TritonTagTableChecker(TagTableChecker):
    def __init__(self, initial_tags: list[int], page_size: int, device: torch.device) -> None:
        from densa.kernels.triton_common import require_triton

        require_triton()
        super().__init__(initial_tags, page_size, device)

    def mismatching_rows(self, page_ids: list[int], expected: list[int]) -> list[int]:
        from densa.kernels.triton_integrity import check_tags

        pairs = torch.tensor([page_ids, expected], dtype=torch.int64)  # [2, n]
        if self.device.type == "cuda":
            pairs = pairs.pin_memory().to(self.device, non_blocking=True)
        count, flags = check_tags(self.tags, pairs)
        if count == 0:
            return []
        return flags.nonzero().flatten().tolist()
