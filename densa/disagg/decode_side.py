"""The decode worker's side of a KV handoff. D drives, so destination pages exist and are tagged
before any byte moves:

    WAITING_PEER --handshake ok--> WAITING_PAGES --pages reserved--> REQUESTED --KVPages--> LANDED
      |                              |                             | (damaged: KVResend, stay)
      +--refused/timeout-> CLOSED    +--gone/timeout--> CLOSED     +--PrefillFailed--> CLOSED
                                                                   +--gone/timeout--> ABORTING
    ABORTING --AbortAck / late KVPages (dropped) / PrefillFailed / timeout--> CLOSED

Ownership: from REQUESTED on, P may be writing into the destination pages, so the request holds
them (`hold_pages`) even once it has ended (client gone, timeout): they are freed only in CLOSED,
when P said it stopped, or after the abort timeout, past which a late write is still refused by
the page tags (the pages were released, so their tags changed) and counted.
Every state has a deadline; `poll` (called by the engine loop at least every 100 ms, idle or
not) fires them, so cleanup never waits for new traffic. LANDED and CLOSED transfers are kept as
tombstones for a while, so a duplicate or late message is recognised and dropped.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from densa.disagg import messages as m
from densa.disagg.handshake import mismatch
from densa.disagg.ports import DecodeEngine, Landing, Reservation
from densa.disagg.stats import AgentStats
from densa.disagg.transport import KVTransport
from densa.disagg.wire import WireError, check_frames
from densa.utils.logging import get_logger

logger = get_logger(__name__)

# P's answer to a request from a peer it has not shaken hands with (it restarted meanwhile).
UNKNOWN_PEER = "kv_peer_unknown"
MAX_RESENDS = 2  # damaged frames asked again before the transfer fails
TOMBSTONE_S = 60.0  # how long a finished transfer is remembered (late and duplicate messages)


class DecodeState(enum.Enum):
    WAITING_PEER = "waiting_peer"
    WAITING_PAGES = "waiting_pages"
    REQUESTED = "requested"
    ABORTING = "aborting"
    LANDED = "landed"
    CLOSED = "closed"


_TERMINAL = (DecodeState.LANDED, DecodeState.CLOSED)


@dataclass
class _Peer:
    address: str
    peer_id: str
    ready: bool = False
    error: str | None = None
    deadline: float = 0.0


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


class DecodeAgent:
    def __init__(
        self,
        engine: DecodeEngine,
        transport: KVTransport,
        model: m.PeerModel,
        timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.transport = transport
        self.model = model
        self.timeout_s = timeout_s
        self.clock = clock
        self.stats = AgentStats()
        self.transfers: dict[str, DecodeTransfer] = {}
        self._by_request: dict[str, str] = {}
        self._peers: dict[str, _Peer] = {}
        self._ids = itertools.count()

    # ---- entry points ----------------------------------------------------------------------------
    def start(self, request_id: str, address: str) -> DecodeTransfer:
        """Take over a request the engine admitted as receiving; its prefill runs at `address`."""
        peer = self._peer(address)
        transfer = DecodeTransfer(
            transfer_id=f"{request_id}#{next(self._ids)}",
            request_id=request_id,
            address=address,
            state=DecodeState.WAITING_PEER,
            deadline=self.clock() + self.timeout_s,
        )
        self.transfers[transfer.transfer_id] = transfer
        self._by_request[request_id] = transfer.transfer_id
        if peer.ready or peer.error:
            self._after_handshake(transfer, peer)
        return transfer

    def poll(self) -> bool:
        """Take every message in, then advance every transfer (deadlines included). Returns
        whether anything happened (the engine then reports its stats afresh)."""
        before = self._fingerprint()
        received = self.transport.receive()
        for peer_id, frames in received:
            self._receive(peer_id, frames)
        now = self.clock()
        for transfer in list(self.transfers.values()):
            self._advance(transfer, now)
        return bool(received) or self._fingerprint() != before

    def _fingerprint(self) -> list[tuple[str, DecodeState]]:
        return [(t.transfer_id, t.state) for t in self.transfers.values()]

    def is_busy(self) -> bool:
        return any(t.state not in _TERMINAL for t in self.transfers.values())

    def gauges(self) -> dict[str, int]:
        counts = {f"in_{state.value}": 0 for state in DecodeState if state not in _TERMINAL}
        for transfer in self.transfers.values():
            if transfer.state not in _TERMINAL:
                counts[f"in_{transfer.state.value}"] += 1
        return counts

    # ---- peers -----------------------------------------------------------------------------------
    def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        # A refused or silent peer is asked again once its deadline passed (it may be replaced).
        if peer is None or (not peer.ready and self.clock() > peer.deadline):
            peer = _Peer(address, self.transport.connect(address))
            peer.deadline = self.clock() + self.timeout_s
            self._peers[address] = peer
            self._send(peer.peer_id, m.PeerHello(self.model))
        return peer

    def _on_welcome(self, peer_id: str, welcome: m.PeerWelcome) -> None:
        peer = next((p for p in self._peers.values() if p.peer_id == peer_id), None)
        if peer is None or peer.ready:
            return
        peer.error = mismatch(self.model, welcome.model) or welcome.error
        peer.ready = peer.error is None
        if peer.error:
            self.stats.add("handshake_failures")
            logger.error("prefill worker %s refused: %s", peer.address, peer.error)
            peer.deadline = self.clock() + 1.0  # retried after a second (it may be replaced)
        else:
            logger.info("prefill worker %s: %s", peer.address, welcome.model.weight_format)
        for transfer in list(self.transfers.values()):
            if transfer.address == peer.address and transfer.state == DecodeState.WAITING_PEER:
                self._after_handshake(transfer, peer)

    def _after_handshake(self, transfer: DecodeTransfer, peer: _Peer) -> None:
        if not self.engine.is_receiving(transfer.request_id):  # ended meanwhile
            self._close_unreserved(transfer, None)
        elif peer.error:
            self._close_unreserved(transfer, peer.error)
        else:
            self._enter(transfer, DecodeState.WAITING_PAGES)
            self._try_reserve(transfer)

    # ---- the state machine -----------------------------------------------------------------------
    def _advance(self, transfer: DecodeTransfer, now: float) -> None:
        state = transfer.state
        if state in _TERMINAL:
            if now > transfer.deadline:
                del self.transfers[transfer.transfer_id]
            return
        gone = not self.engine.is_receiving(transfer.request_id)
        if state in (DecodeState.WAITING_PEER, DecodeState.WAITING_PAGES):
            if gone:
                self._close_unreserved(transfer, None)
            elif now > transfer.deadline:
                self.stats.add("timeouts")
                self._close_unreserved(transfer, self._timeout_error(state))
            elif state == DecodeState.WAITING_PAGES:
                self._try_reserve(transfer)
        elif state == DecodeState.REQUESTED:
            if gone:
                self._abort(transfer)
            elif now > transfer.deadline:
                self.stats.add("timeouts")
                self.engine.fail_remote(transfer.request_id, self._timeout_error(state))
                self.stats.add("transfers_failed")
                self._abort(transfer)
        elif state == DecodeState.ABORTING and now > transfer.deadline:
            self.stats.add("timeouts")
            self._close(transfer)  # P never answered; a late write is refused by the tags

    def _timeout_error(self, state: DecodeState) -> str:
        what = {
            DecodeState.WAITING_PEER: "the prefill worker did not answer the handshake",
            DecodeState.WAITING_PAGES: "no KV pages became free for the prompt",
            DecodeState.REQUESTED: "the prefill worker did not deliver the prompt's KV pages",
        }[state]
        return f"kv_transfer_timeout: {what} within {self.timeout_s:g} s"

    def _try_reserve(self, transfer: DecodeTransfer) -> None:
        reservation = self.engine.reserve_remote(transfer.request_id)
        if reservation is None:
            return
        transfer.reservation = reservation
        transfer.started_at = self.clock()
        self._enter(transfer, DecodeState.REQUESTED)
        self.stats.add("transfers_started")
        self._send_request(transfer)

    def _send_request(self, transfer: DecodeTransfer) -> None:
        r = transfer.reservation
        assert r is not None
        request = m.PrefillRequest(
            transfer.transfer_id, r.prompt_token_ids, r.params, r.cache_scope, r.first_block,
            r.dest_page_ids, r.dest_tags,
        )  # fmt: skip
        self._send(self._peers[transfer.address].peer_id, request)

    def _abort(self, transfer: DecodeTransfer) -> None:
        """The request no longer wants the pages, but P may still be writing: hold, ask, wait."""
        self.stats.add("transfers_aborted")
        self._enter(transfer, DecodeState.ABORTING)
        self._send(self._peers[transfer.address].peer_id, m.AbortTransfer(transfer.transfer_id))

    def _close_unreserved(self, transfer: DecodeTransfer, error: str | None) -> None:
        if error is not None:
            self.stats.add("transfers_failed")
            self.engine.fail_remote(transfer.request_id, error)
        self._close(transfer)

    def _close(self, transfer: DecodeTransfer) -> None:
        self.engine.release_held(transfer.request_id)
        self._enter(transfer, DecodeState.CLOSED, linger=True)

    def _enter(self, transfer: DecodeTransfer, state: DecodeState, linger: bool = False) -> None:
        transfer.history.append(transfer.state)
        transfer.state = state
        transfer.deadline = self.clock() + (TOMBSTONE_S if linger else self.timeout_s)
        if state in _TERMINAL:
            self._by_request.pop(transfer.request_id, None)

    # ---- messages --------------------------------------------------------------------------------
    def _receive(self, peer_id: str, frames: list[memoryview]) -> None:
        try:
            message = m.decode(frames[0])
        except (m.DecodeError, IndexError):
            self.stats.add("undecodable_messages")
            logger.warning("dropped an undecodable message from %s", peer_id)
            return
        if isinstance(message, m.PeerWelcome):
            self._on_welcome(peer_id, message)
            return
        transfer_id = getattr(message, "transfer_id", None)
        transfer = self.transfers.get(transfer_id) if transfer_id else None
        if isinstance(message, m.KVPages):
            self._on_pages(peer_id, transfer, message, frames[1:])
        elif isinstance(message, m.PrefillFailed):
            self._on_prefill_failed(transfer, message)
        elif isinstance(message, m.AbortAck):
            if transfer is not None and transfer.state == DecodeState.ABORTING:
                self._close(transfer)
            else:
                self.stats.add("duplicate_messages_dropped")

    def _on_pages(
        self,
        peer_id: str,
        transfer: DecodeTransfer | None,
        message: m.KVPages,
        frames: list[memoryview],
    ) -> None:
        if (
            transfer is not None
            and transfer.state == DecodeState.REQUESTED
            and not self.engine.is_receiving(transfer.request_id)
        ):
            self._enter(transfer, DecodeState.ABORTING)  # it ended since the last poll
        if transfer is None or transfer.state != DecodeState.REQUESTED:
            self._drop_late_pages(peer_id, transfer, message)
            return
        try:
            check_frames(message.layout, frames, len(message.dest_page_ids))
            self._check_destination(transfer, message)
        except WireError as exc:
            self._on_damaged(transfer, str(exc))
            return
        landing = Landing(
            message.dest_page_ids, message.dest_tags, message.layout, frames,
            message.first_token_id, message.first_logprobs, message.num_cached_tokens,
        )  # fmt: skip
        started = self.clock()
        refused = self.engine.land_remote(transfer.request_id, landing)
        self._send(peer_id, m.KVAck(message.transfer_id))  # either way P may free its pages
        if refused is not None:
            self.stats.add("stale_writes_dropped")
            logger.error("transfer %s refused at landing: %s", transfer.transfer_id, refused)
            self._close(transfer)
            return
        now = self.clock()
        self.stats.add("transfers_landed")
        self.stats.add("pages", len(message.dest_page_ids))
        self.stats.add("bytes", sum(f.nbytes for f in frames))
        self.stats.add("landing_ms", 1000 * (now - started))
        self.stats.add("transfer_ms", 1000 * (now - transfer.started_at))
        self.stats.add("prefill_ms", message.prefill_ms)
        self._enter(transfer, DecodeState.LANDED, linger=True)

    def _check_destination(self, transfer: DecodeTransfer, message: m.KVPages) -> None:
        r = transfer.reservation
        assert r is not None
        if message.dest_page_ids != r.dest_page_ids or message.dest_tags != r.dest_tags:
            raise WireError("the pages name other destinations than this transfer reserved")

    def _on_damaged(self, transfer: DecodeTransfer, why: str) -> None:
        self.stats.add("damaged_transfers")
        logger.warning("transfer %s arrived damaged (%s)", transfer.transfer_id, why)
        if transfer.num_resends < MAX_RESENDS:
            transfer.num_resends += 1
            self._send(self._peers[transfer.address].peer_id, m.KVResend(transfer.transfer_id))
            return
        error = f"kv_transfer_failed: the prompt's KV pages arrived damaged {1 + MAX_RESENDS} times"
        self.engine.fail_remote(transfer.request_id, error)
        self.stats.add("transfers_failed")
        self._abort(transfer)

    def _drop_late_pages(
        self, peer_id: str, transfer: DecodeTransfer | None, message: m.KVPages
    ) -> None:
        """Pages for a transfer that no longer waits for them: never written; P may free."""
        self._send(peer_id, m.KVAck(message.transfer_id))
        if transfer is not None and transfer.state == DecodeState.LANDED:
            self.stats.add("duplicate_messages_dropped")
            return
        self.stats.add("late_transfers_dropped")
        logger.warning(
            "dropped late KV pages of transfer %s (%s): pages %s, tags %s",
            message.transfer_id, transfer.state.value if transfer else "unknown",
            message.dest_page_ids, message.dest_tags,
        )  # fmt: skip
        if transfer is not None and transfer.state == DecodeState.ABORTING:
            self._close(transfer)  # P's writer is done: the pages can go

    def _on_prefill_failed(self, transfer: DecodeTransfer | None, message: m.PrefillFailed) -> None:
        if transfer is None or transfer.state in _TERMINAL:
            self.stats.add("duplicate_messages_dropped")
            return
        if message.error.startswith(UNKNOWN_PEER):  # P restarted: handshake again next time
            self._peers[transfer.address].ready = False
            self._peers[transfer.address].deadline = 0.0
        if transfer.state == DecodeState.REQUESTED:
            self.stats.add("transfers_failed")
            self.engine.fail_remote(transfer.request_id, message.error)
        self._close(transfer)  # P stopped: nothing is writing into the pages

    def _send(self, peer_id: str, message: m.PeerMessage) -> None:
        self.transport.send(peer_id, [m.encode(message)])
