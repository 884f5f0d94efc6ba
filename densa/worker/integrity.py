"""The device-side half of KV integrity: a tag table next to the KV pages, and batched checks.

Per step: mirror the pool's tag changes into the table, then compare every (page, expected tag)
pair the step's requests map against it -- one gather and one compare for the whole step, separate
from attention. Requests with a mismatch are dropped from the step before the forward pass, so they
neither read foreign pages nor write into them. With the Triton backend (GPU tag tables) the
comparison is one Triton kernel instead (TritonTagTableChecker, densa.kernels.triton.integrity).
"""

from __future__ import annotations

from typing import Protocol

import torch

from densa.cache.integrity import IntegrityViolation, classify
from densa.kernels.reference import integrity as reference_integrity
from densa.sched.mirror import ScheduledRequest


class IntegrityChecker(Protocol):
    def apply_tag_updates(self, updates: list[tuple[int, int]]) -> None:
        """Mirror tag changes decided by the page pool (mutates the tag table only)."""
        ...

    def check_step(self, scheduled: list[ScheduledRequest]) -> dict[str, IntegrityViolation]:
        """First mismatching page of each request whose step would touch a page it does not own."""
        ...

    def check_write(
        self, request_id: str, page_ids: list[int], expected_tags: list[int]
    ) -> IntegrityViolation | None:
        """Before a copy/transfer lands: does the writer still own every destination page?"""
        ...


class NoopIntegrityChecker:
    """--kv-integrity off: no table, no work."""

    def apply_tag_updates(self, updates: list[tuple[int, int]]) -> None:
        return None

    def check_step(self, scheduled: list[ScheduledRequest]) -> dict[str, IntegrityViolation]:
        return {}

    def check_write(
        self, request_id: str, page_ids: list[int], expected_tags: list[int]
    ) -> IntegrityViolation | None:
        return None


class TagTableChecker:
    def __init__(self, initial_tags: list[int], page_size: int, device: torch.device) -> None:
        self.num_pages = len(initial_tags)
        self.page_size = page_size
        self.tags = torch.tensor(initial_tags, dtype=torch.int64, device=device)  # [num_pages]
        self.device = device

    def apply_tag_updates(self, updates: list[tuple[int, int]]) -> None:
        if not updates:
            return
        # Later updates of the same page win: index_put_ applies them in order on CPU, but to be
        # safe on every device keep only the last tag per page.
        latest = dict(updates)
        pages = torch.tensor(list(latest), dtype=torch.int64, device=self.device)
        self.tags[pages] = torch.tensor(
            list(latest.values()), dtype=torch.int64, device=self.device
        )

    def check_step(self, scheduled: list[ScheduledRequest]) -> dict[str, IntegrityViolation]:
        page_ids: list[int] = []
        expected: list[int] = []
        for item in scheduled:
            num_pages = -(-item.end_pos // self.page_size)  # pages read or written this step
            page_ids.extend(item.page_ids[:num_pages])
            expected.extend(item.page_tags[:num_pages])
        if not page_ids:
            return {}
        bad_rows = self.mismatching_rows(page_ids, expected)
        if not bad_rows:  # the common case
            return {}
        found = self.tags[torch.tensor(page_ids, dtype=torch.int64, device=self.device)]
        return self._violations(scheduled, bad_rows, found.tolist())

    def mismatching_rows(self, page_ids: list[int], expected: list[int]) -> list[int]:
        """Rows i with tags[page_ids[i]] != expected[i]: one gather, one compare, one sync."""
        return reference_integrity.mismatching_rows(self.tags, page_ids, expected)

    def _violations(
        self, scheduled: list[ScheduledRequest], bad_rows: list[int], found: list[int]
    ) -> dict[str, IntegrityViolation]:
        violations: dict[str, IntegrityViolation] = {}
        row = 0
        bad = set(bad_rows)
        for item in scheduled:
            num_pages = -(-item.end_pos // self.page_size)
            first_written = item.start_pos // self.page_size
            for idx in range(num_pages):
                if row + idx in bad and item.request_id not in violations:
                    page, tag = item.page_ids[idx], item.page_tags[idx]
                    kind = classify(page, tag, self.num_pages, is_write=idx >= first_written)
                    violations[item.request_id] = IntegrityViolation(
                        item.request_id, kind, page, tag, found[row + idx]
                    )
            row += num_pages
        return violations

    def check_write(
        self, request_id: str, page_ids: list[int], expected_tags: list[int]
    ) -> IntegrityViolation | None:
        pages = torch.tensor(page_ids, dtype=torch.int64, device=self.device)
        found = self.tags[pages]
        mismatch = found != torch.tensor(expected_tags, dtype=torch.int64, device=self.device)
        if not bool(mismatch.any()):
            return None
        idx = int(mismatch.nonzero()[0])
        kind = classify(page_ids[idx], expected_tags[idx], self.num_pages, is_write=True)
        return IntegrityViolation(
            request_id, kind, page_ids[idx], expected_tags[idx], int(found[idx])
        )


class TritonTagTableChecker(TagTableChecker):
    """The tag-table checker with its batched comparison as one Triton kernel: the step's (page,
    expected tag) pairs go to the device in one copy, one kernel compares and counts, and one
    4-byte read-back says whether anything mismatched (against a gather, a compare, an any() and
    their syncs in torch). Everything else is TagTableChecker's."""

    def __init__(self, initial_tags: list[int], page_size: int, device: torch.device) -> None:
        from densa.kernels.triton.common import require_triton

        require_triton()
        super().__init__(initial_tags, page_size, device)

    def mismatching_rows(self, page_ids: list[int], expected: list[int]) -> list[int]:
        from densa.kernels.triton import integrity as triton_integrity

        return triton_integrity.mismatching_rows(self.tags, page_ids, expected)
