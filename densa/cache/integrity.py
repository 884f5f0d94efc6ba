"""KV page integrity: what a violation is, how it is classified, and counting them.

A request records (page id, tag) for every page it maps. Before a step reads or writes pages, the
worker compares those expected tags with the pages' current tags in one batched check; before a
copy or transfer lands, the writer's tag is checked the same way. A mismatch means the request no
longer owns the page: it is aborted, and nothing it would have read or written takes effect.

What this cannot catch: wrong numbers inside a page the request does own (a kernel bug writing
garbage into the right page, memory corruption that leaves the tag intact). Tags guard ownership,
not content.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from dataclasses import dataclass

logger = logging.getLogger("densa.integrity")

ERROR_CODE = "kv_integrity_violation"


class ViolationKind(enum.Enum):
    STALE_READ = "stale_read"  # would read a page released (and maybe reused) since it was mapped
    STALE_WRITE = "stale_write"  # would write into a page released since it was issued
    BAD_MAPPING = "bad_mapping"  # a page-table entry points at a page the tag was not issued for
    DOUBLE_FREE = "double_free"  # released a page that had no reference left


@dataclass(frozen=True)
class IntegrityViolation:
    request_id: str
    kind: ViolationKind
    page_id: int
    expected_tag: int
    found_tag: int

    @property
    def message(self) -> str:
        return (
            f"{ERROR_CODE}: {self.kind.value} on KV page {self.page_id} "
            f"(expected tag {self.expected_tag}, found {self.found_tag}); request aborted"
        )


def classify(page_id: int, expected_tag: int, num_pages: int, is_write: bool) -> ViolationKind:
    """Tags encode the page they were issued for (tag % num_pages), which tells a corrupt mapping
    from a stale one."""
    if expected_tag % num_pages != page_id:
        return ViolationKind.BAD_MAPPING
    return ViolationKind.STALE_WRITE if is_write else ViolationKind.STALE_READ


class IntegrityStats:
    """Counts violations by kind and logs each with its request, page and tags."""

    def __init__(self) -> None:
        self.counts: Counter[ViolationKind] = Counter()

    def record(self, violation: IntegrityViolation) -> None:
        self.counts[violation.kind] += 1
        logger.error(
            "KV integrity violation kind=%s request=%s page=%d expected_tag=%d found_tag=%d",
            violation.kind.value,
            violation.request_id,
            violation.page_id,
            violation.expected_tag,
            violation.found_tag,
        )

    @property
    def total(self) -> int:
        return sum(self.counts.values())
