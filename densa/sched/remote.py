"""Requests whose prompt K/V another worker computes (densa/disagg), and pages held for transfers.

The scheduler's own state (Scheduler.remote); the engine's disaggregation port asks the scheduler,
it never reaches in. A remote request goes through:

    add          reserve                     queue_landing               the step applies it
   ----> RECEIVING ----> RESERVED ------------------> LANDING ------------------> running
         no pages        prefix hit mapped, the       bytes in hand, queued       pages written
                         rest allocated and tagged;   for the next step: the      (tags checked by
                         hold_pages (a peer may       writer is local now, so     the runner),
                         write into them)             hold_pages is off           indexed, first
                                                                                  token appended

Held pages: when a request with hold_pages ends (a RESERVED one whose client left, or a prefill
worker's finished prompt), its pages move to `held` until the transfer says no writer is left
(`release`); until then nothing can reuse them. A request that ends while LANDING simply frees
its pages: its landing is dropped, and no one else writes into them.
"""

from __future__ import annotations

from dataclasses import dataclass

from densa.cache.integrity import IntegrityViolation
from densa.cache.kv_manager import KVCacheManager
from densa.request import Request
from densa.sched.output import KVLanding


@dataclass(frozen=True)
class RemoteReservation:
    """A receiving request's pages, reserved before any byte moves."""

    request: Request
    first_block: int  # blocks [0, first_block) are mapped from the prefix cache: never written

    @property
    def dest_page_ids(self) -> list[int]:
        return self.request.page_ids[self.first_block :]

    @property
    def dest_tags(self) -> list[int]:
        return self.request.page_tags[self.first_block :]


class RemoteRequests:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        # Admitted, not scheduled until their K/V lands (RECEIVING, RESERVED and LANDING).
        self.receiving: dict[str, Request] = {}
        # Landings waiting for the next step, by request id (LANDING).
        self._landings: dict[str, KVLanding] = {}
        # Pages of ended requests that a transfer may still touch: owner id -> (pages, tags),
        # tail first (as KVCacheManager.free releases them, so tail pages are evicted first).
        self.held: dict[str, tuple[list[int], list[int]]] = {}

    def add(self, request: Request) -> None:
        self.receiving[request.request_id] = request

    @property
    def num_reserved(self) -> int:
        """Receiving requests holding pages (they count against the sequence slots)."""
        return sum(1 for r in self.receiving.values() if r.page_ids)

    def reserve(self, request_id: str) -> RemoteReservation | None:
        """Map the request's prefix hit and allocate (and tag) pages for the rest of its prompt;
        None (nothing changed) while there is no room."""
        request = self.receiving[request_id]
        hit = self.kv.find_prefix(request)
        num_hit_tokens = hit.num_tokens(self.kv.page_size)
        if self.kv.allocate_slots(request, request.num_prompt_tokens - num_hit_tokens, hit) is None:
            return None
        self.kv.record_prefix_query(request, hit)
        request.num_cached_tokens = num_hit_tokens
        request.hold_pages = True  # from now on a transfer may write into its pages
        return RemoteReservation(request, num_hit_tokens // self.kv.page_size)

    def queue_landing(self, landing: KVLanding) -> IntegrityViolation | None:
        """Queue copied-in pages for the next step, if the request still owns every destination
        page with the tag it was issued, alone (else nothing is queued: the violation)."""
        request = self.receiving.get(landing.request_id)
        violation = self.kv.check_writer(
            landing.request_id, request, landing.page_ids, landing.page_tags
        )
        if violation is not None:
            return violation
        assert request is not None  # check_writer refuses a writer that maps no pages
        request.hold_pages = False  # the bytes are here: no writer is left outside this worker
        self._landings[landing.request_id] = landing
        return None

    def take_landings(self) -> list[KVLanding]:
        """The queued landings, for the step being scheduled (in the order they were queued)."""
        landings, self._landings = list(self._landings.values()), {}
        return landings

    @property
    def has_landings(self) -> bool:
        return bool(self._landings)

    def landed(self, request_id: str) -> Request | None:
        """The request whose landing the step applied, no longer receiving (None: it ended)."""
        return self.receiving.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The request ended: it waits for nothing, and a queued landing is dropped."""
        self.receiving.pop(request_id, None)
        self._landings.pop(request_id, None)

    # ---- held pages ------------------------------------------------------------------------------
    def hold(self, request: Request) -> None:
        self.held[request.request_id] = (request.page_ids[::-1], request.page_tags[::-1])
        request.page_ids, request.page_tags = [], []

    def release(self, owner_id: str) -> list[IntegrityViolation]:
        """Free the pages a finished request left held (idempotent); pages found not its own."""
        held = self.held.pop(owner_id, None)
        if held is None:
            return []
        page_ids, tags = held
        return self.kv.release(owner_id, page_ids, tags)

    def held_page_ids(self, owner_id: str) -> list[int] | None:
        """The held pages in block order (None: it holds none)."""
        held = self.held.get(owner_id)
        return None if held is None else held[0][::-1]

    @property
    def num_held_pages(self) -> int:
        return sum(len(page_ids) for page_ids, _ in self.held.values())
