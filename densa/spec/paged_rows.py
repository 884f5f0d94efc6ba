"""What the proposers that keep their own paged KV (a draft model, an MTP layer) share: one
request's chunk of positions in a forward pass, the pages it writes into, and the attention
metadata of a batch of such chunks.

    row:       token_ids at positions [start_pos, end_pos) of `seq`
    pages:     seq.page_ids[p // page_size] holds position p's K/V
    tags:      seq.page_tags[i] is page_ids[i]'s tag when it was allocated for `seq`
    last row:  the chunk's final position, whose output proposes the next token

The proposer's own page pool gives its pages generation tags exactly as the target's does
(densa/cache/page_pool.py): a page's tag changes when it is allocated and when it is freed (a
release, or a rollback past a rejected proposal). A sequence records its pages' tags, and
`stale_page` compares them with the pool's before a forward reads the pages, so a page freed
behind a sequence's back (and maybe reused by another request) is never read as its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from densa.cache.integrity import IntegrityViolation, classify
from densa.cache.page_pool import PagePool
from densa.model.attention import AttentionGroup, AttentionMetadata, build_group
from densa.spec.proposer import SpecInput


class PagedSequence(Protocol):
    page_ids: list[int]
    page_tags: list[int]  # the tag of each of page_ids when it was allocated for this sequence


S = TypeVar("S", bound=PagedSequence)
R = TypeVar("R", bound="ChunkRow[Any]")


@dataclass(frozen=True)
class ChunkRow(Generic[S]):
    """One request's chunk in a proposer's forward: tokens at positions [start_pos, end_pos)."""

    seq: S
    token_ids: list[int]
    start_pos: int

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


def num_to_propose(spec: SpecInput, max_model_len: int) -> int:
    """k, less what would run past the proposer's positions (proposal i is fed at n + i - 1)."""
    return max(0, min(spec.num_tokens, max_model_len - len(spec.token_ids) + 1))


def propose_greedily(
    inputs: Sequence[SpecInput],
    max_model_len: int,
    catch_up: Callable[[SpecInput, int], R | None],
    forward: Callable[[int, list[R]], list[tuple[int, R]]],
) -> list[list[int]]:
    """Up to k proposals per request, one forward of every row per step: the first forward
    catches each request up (`catch_up`: its row, None when there is no room), later ones feed
    it its own last proposal. `forward(step, rows)` gives, per row, the argmax next token and
    the row that feeds it on."""
    proposals: list[list[int]] = [[] for _ in inputs]
    wanted = [num_to_propose(spec, max_model_len) for spec in inputs]
    rows: dict[int, R] = {}
    for idx, spec in enumerate(inputs):
        row = catch_up(spec, wanted[idx]) if wanted[idx] > 0 else None
        if row is not None:
            rows[idx] = row
    for step in range(max(wanted, default=0)):
        if not rows:
            break
        order = list(rows)
        results = forward(step, [rows.pop(idx) for idx in order])
        for idx, (token_id, next_row) in zip(order, results, strict=True):
            proposals[idx].append(token_id)
            if step + 1 < wanted[idx]:
                rows[idx] = next_row
    return proposals


def num_pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def page_table(row: ChunkRow[Any], page_size: int) -> list[int]:
    """The pages positions [0, end_pos) of the row's sequence live in."""
    return row.seq.page_ids[: num_pages_for(row.end_pos, page_size)]


def grow_pages(pool: PagePool, seq: PagedSequence, num_tokens: int, page_size: int) -> bool:
    """Allocate the pages `seq` lacks for positions [0, num_tokens); False (nothing allocated)
    when the pool has too few free."""
    missing = num_pages_for(num_tokens, page_size) - len(seq.page_ids)
    if missing <= 0:
        return True
    page_ids = pool.allocate(missing)
    if page_ids is None:
        return False
    seq.page_ids.extend(page_ids)
    seq.page_tags.extend(pool.tags(page_ids))
    return True


def free_pages_from(pool: PagePool, seq: PagedSequence, page_idx: int) -> None:
    """Free the sequence's pages from index page_idx on (their tags change: a rollback or a
    release). A page whose tag changed already is no longer the sequence's: it is dropped from
    its list without a free (that would take another owner's reference)."""
    owned = [
        page_id
        for page_id, tag in zip(seq.page_ids[page_idx:], seq.page_tags[page_idx:], strict=True)
        if pool.tag(page_id) == tag
    ]
    pool.free(owned)
    del seq.page_ids[page_idx:]
    del seq.page_tags[page_idx:]


def stale_page(pool: PagePool, seq: PagedSequence, request_id: str) -> IntegrityViolation | None:
    """The first page the sequence maps whose tag is not the one it was allocated with (freed
    or reallocated since), as a violation; None when the sequence still owns all its pages."""
    for page_id, tag in zip(seq.page_ids, seq.page_tags, strict=True):
        found = pool.tag(page_id)
        if found != tag:
            kind = classify(page_id, tag, pool.num_pages, is_write=False)
            return IntegrityViolation(request_id, kind, page_id, tag, found)
    return None


class OwnPages(Generic[S]):
    """A proposer's pages in a pool of its own: each request's sequence, its release, and the
    stale pages found before a read (kept for the engine to count: `take_violations`)."""

    def __init__(self, num_pages: int) -> None:
        # Unmirrored: only the target pool's tags are mirrored into the worker's table; the
        # proposer checks its own with stale_page.
        self.pool = PagePool(num_pages, mirrored=False)
        self.sequences: dict[str, S] = {}
        self.violations: list[IntegrityViolation] = []  # since the last take_violations

    def release(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            free_pages_from(self.pool, seq, 0)

    def take_violations(self) -> list[IntegrityViolation]:
        violations, self.violations = self.violations, []
        return violations

    def _dropped_if_stale(self, seq: S, request_id: str) -> bool:
        """Whether a page of the request was freed behind its back; if so the violation is
        kept (counted like the target's, docs/integrity.md) and the request's state released:
        that ends its speculation, never the request (the target verifies every token)."""
        violation = stale_page(self.pool, seq, request_id)
        if violation is None:
            return False
        self.violations.append(violation)
        self.release(request_id)
        return True


def positions_of(rows: Sequence[ChunkRow[Any]]) -> torch.Tensor:
    """[T] int64: every row's positions, row after row (on the host)."""
    positions = [p for row in rows for p in range(row.start_pos, row.end_pos)]
    return torch.tensor(positions, dtype=torch.long)


def prefill_group(
    rows: Sequence[ChunkRow[Any]], page_size: int, device: torch.device
) -> AttentionGroup:
    """Each row as one chunk attending to its sequence's positions [0, end_pos)."""
    return build_group(
        start=0,
        page_tables=[page_table(row, page_size) for row in rows],
        seq_lens=[row.end_pos for row in rows],
        query_lens=[len(row.token_ids) for row in rows],
        page_size=page_size,
        device=device,
    )


def chunk_metadata(
    rows: Sequence[ChunkRow[Any]],
    positions: torch.Tensor,
    group: AttentionGroup,
    as_decode: bool,
    page_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Where each row's new K/V goes (its positions' slots), and the one attention group."""
    slot_pages = [
        row.seq.page_ids[p // page_size] for row in rows for p in range(row.start_pos, row.end_pos)
    ]
    return AttentionMetadata(
        slot_pages=torch.tensor(slot_pages, dtype=torch.long, device=device),
        slot_offsets=(positions % page_size).to(device),
        decode=group if as_decode else None,
        prefill=None if as_decode else group,
    )


def last_rows(rows: Sequence[ChunkRow[Any]]) -> list[int]:
    """Index, in the flattened batch, of each row's final position."""
    ends, total = [], 0
    for row in rows:
        total += len(row.token_ids)
        ends.append(total - 1)
    return ends
