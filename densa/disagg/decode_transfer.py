"""One KV handoff as the decode side tracks it: its state (the diagram is in decode_side.py)
and what it holds while it moves through them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from densa.disagg.ports import Reservation


class DecodeState(enum.Enum):
    WAITING_PEER = "waiting_peer"
    WAITING_PAGES = "waiting_pages"
    REQUESTED = "requested"
    ABORTING = "aborting"
    LANDED = "landed"
    CLOSED = "closed"


# Kept as tombstones for a while, so a late or duplicate message is recognised and dropped.
TERMINAL = (DecodeState.LANDED, DecodeState.CLOSED)


@dataclass
class DecodeTransfer:
    transfer_id: str
    request_id: str
    address: str
    state: DecodeState
    deadline: float
    started_at: float = 0.0
    num_resends: int = 0
    reservation: Reservation | None = None
    history: list[DecodeState] = field(default_factory=list)
