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

Trust (docs/security.md): a message counts only if its MAC verifies under the session this agent
shook hands for with that very peer (densa/auth/frames.py), and a transfer takes messages only
from the peer it asked. What an authentic message says is still checked against the local model
and the reservation (pages, tags, layout, first token, cached tokens): a bad one fails that
transfer alone. Any exception while handling one message is confined the same way.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from densa.auth.frames import LinkKeys
from densa.disagg import messages as m
from densa.disagg.decode_peers import DecodePeers, Peer
from densa.disagg.decode_transfer import TERMINAL, DecodeState, DecodeTransfer
from densa.disagg.landing_checks import invalid_pages, peer_error
from densa.disagg.ports import DecodeEngine, Landing
from densa.disagg.stats import AgentStats
from densa.disagg.transport import KVTransport, TransportError
from densa.disagg.wire import split_frames
from densa.utils.logging import get_logger

logger = get_logger(__name__)

# P's answer to a request from a peer it has not shaken hands with (it restarted meanwhile).
UNKNOWN_PEER = "kv_peer_unknown"
MAX_RESENDS = 2  # damaged frames asked again before the transfer fails
TOMBSTONE_S = 60.0  # how long a finished transfer is remembered (late and duplicate messages)


class DecodeAgent:
    def __init__(
        self,
        engine: DecodeEngine,
        transport: KVTransport,
        model: m.PeerModel,
        timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        keys: LinkKeys,  # from the cluster secret: there is no link without one
    ) -> None:
        self.engine = engine
        self.transport = transport
        self.model = model
        self.keys = keys
        vocab_size = model.architecture.get("vocab_size")
        self.vocab_size = vocab_size if isinstance(vocab_size, int) else 0
        self.timeout_s = timeout_s
        self.clock = clock
        self.stats = AgentStats()
        self.transfers: dict[str, DecodeTransfer] = {}
        self._by_request: dict[str, str] = {}
        self.peers = DecodePeers(transport, model, self.keys, timeout_s, clock, self.stats)
        self._ids = itertools.count()

    # ---- entry points ----------------------------------------------------------------------------
    def start(self, request_id: str, address: str) -> DecodeTransfer:
        """Take over a request the engine admitted as receiving; its prefill runs at `address`."""
        transfer = DecodeTransfer(
            transfer_id=f"{request_id}#{next(self._ids)}",
            request_id=request_id,
            address=address,
            state=DecodeState.WAITING_PEER,
            deadline=self.clock() + self.timeout_s,
        )
        self.transfers[transfer.transfer_id] = transfer
        self._by_request[request_id] = transfer.transfer_id
        try:
            peer = self.peers.connect(address, self._addresses_in_use)
        except TransportError as exc:
            self.stats.add("peer_unreachable")
            self._close_unreserved(transfer, f"kv_peer_unreachable: {exc}")
            return transfer
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
        return any(t.state not in TERMINAL for t in self.transfers.values())

    def gauges(self) -> dict[str, int]:
        counts = {f"in_{state.value}": 0 for state in DecodeState if state not in TERMINAL}
        for transfer in self.transfers.values():
            if transfer.state not in TERMINAL:
                counts[f"in_{transfer.state.value}"] += 1
        return counts

    # ---- peers -----------------------------------------------------------------------------------
    def _addresses_in_use(self) -> set[str]:
        return {t.address for t in self.transfers.values() if t.state not in TERMINAL}

    def _on_welcome(self, peer: Peer, welcome: m.PeerWelcome) -> None:
        if peer.ready:
            return
        self.peers.welcome(peer, welcome)
        for transfer in list(self.transfers.values()):
            if transfer.address == peer.address and transfer.state == DecodeState.WAITING_PEER:
                self._after_handshake(transfer, peer)

    def _after_handshake(self, transfer: DecodeTransfer, peer: Peer) -> None:
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
        if state in TERMINAL:
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
            r.dest_page_ids, r.dest_tags, r.with_mtp,
        )  # fmt: skip
        self._send_to(transfer, request)

    def _abort(self, transfer: DecodeTransfer) -> None:
        """The request no longer wants the pages, but P may still be writing: hold, ask, wait."""
        self.stats.add("transfers_aborted")
        self._enter(transfer, DecodeState.ABORTING)
        self._send_to(transfer, m.AbortTransfer(transfer.transfer_id))

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
        if state in TERMINAL:
            self._by_request.pop(transfer.request_id, None)

    # ---- messages --------------------------------------------------------------------------------
    def _receive(self, peer_id: str, frames: list[memoryview]) -> None:
        peer = self.peers.by_id(peer_id)
        if peer is None:  # nobody this agent reached: nothing it says can concern a transfer
            self.stats.add("unauthenticated_messages")
            return
        message = self._authentic(peer, frames)
        if message is None:
            return
        try:
            self._dispatch(peer, message, frames[1:-1])
        except Exception:  # confined: this message's transfer fails, the worker goes on
            self.stats.add("peer_faults")
            logger.exception("handling a %s from %r failed", type(message).__name__, peer_id)
            self._fail_after_fault(getattr(message, "transfer_id", None))

    def _authentic(self, peer: Peer, frames: list[memoryview]) -> m.PeerMessage | None:
        """The message, if its MAC verifies under this peer's session (or, before the session,
        under the welcome key of our hello); None (counted) otherwise."""
        if not self.peers.verify(peer, frames):
            self._on_unauthentic(peer, frames)
            return None
        return self.peers.decode(peer, frames)

    def _on_unauthentic(self, peer: Peer, frames: list[memoryview]) -> None:
        """A MAC that does not verify: damage in flight, a restarted peer, or a forgery. Only
        what the session's peer would be asked anyway follows: a resend of damaged pages (for a
        transfer that waits on this very peer), or a fresh handshake if P forgot us."""
        claimed = m.decode_or_none(frames)
        # "No session" is a header and its MAC: never hash a message's pages a second time.
        if len(frames) == 2 and self.keys.unknown_peer().verify(frames):
            self._on_forgotten(peer, claimed)
            return
        self.stats.add("unauthenticated_messages")
        transfer = None
        if isinstance(claimed, m.KVPages):
            transfer = self.transfers.get(claimed.transfer_id)
        if (
            transfer is not None
            and transfer.state == DecodeState.REQUESTED
            and transfer.address == peer.address
        ):
            self._on_damaged(transfer, "a frame fails its MAC")
            return
        logger.warning("dropped a message from %r that fails its MAC", peer.address)

    def _on_forgotten(self, peer: Peer, message: m.PeerMessage | None) -> None:
        """P answered that it has no session with us (it restarted): shake hands again."""
        if not isinstance(message, m.PrefillFailed) or not message.error.startswith(UNKNOWN_PEER):
            return
        transfer = self.transfers.get(message.transfer_id)
        if transfer is not None and transfer.address == peer.address:
            self._on_prefill_failed(peer, transfer, message)

    def _dispatch(self, peer: Peer, message: m.PeerMessage, frames: list[memoryview]) -> None:
        if isinstance(message, m.PeerWelcome):
            self._on_welcome(peer, message)
            return
        transfer_id = getattr(message, "transfer_id", None)
        transfer = self.transfers.get(transfer_id) if transfer_id else None
        if transfer is not None and transfer.address != peer.address:
            # Bound to the peer that was asked: another prefill worker cannot answer for it.
            self.stats.add("misdirected_messages")
            logger.warning("%r answered for a transfer it was not asked", peer.address)
            return
        if isinstance(message, m.KVPages):
            self._on_pages(peer, transfer, message, frames)
        elif isinstance(message, m.PrefillFailed):
            self._on_prefill_failed(peer, transfer, message)
        elif isinstance(message, m.AbortAck):
            if transfer is not None and transfer.state == DecodeState.ABORTING:
                self._close(transfer)
            else:
                self.stats.add("duplicate_messages_dropped")

    def _fail_after_fault(self, transfer_id: str | None) -> None:
        transfer = self.transfers.get(transfer_id) if transfer_id else None
        if transfer is None or transfer.state in TERMINAL:
            return
        error = "kv_transfer_failed: the prefill worker's answer could not be handled"
        if transfer.state == DecodeState.REQUESTED:
            self.engine.fail_remote(transfer.request_id, error)
            self.stats.add("transfers_failed")
            self._abort(transfer)
        elif transfer.state != DecodeState.ABORTING:
            self._close_unreserved(transfer, error)

    def _on_pages(
        self,
        peer: Peer,
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
            self._drop_late_pages(peer, transfer, message)
            return
        assert transfer.reservation is not None
        invalid = invalid_pages(self.model, self.vocab_size, transfer.reservation, message, frames)
        if invalid is not None:
            self.peers.send(peer, m.KVAck(message.transfer_id))  # P may free its pages
            self.stats.add("invalid_pages")
            self.stats.add("transfers_failed")
            logger.error("transfer %r: %s", transfer.transfer_id, invalid)
            self.engine.fail_remote(transfer.request_id, invalid)
            self._close(transfer)
            return
        parts = split_frames(message, frames)  # checked by invalid_pages
        mtp_frames = None if parts.mtp_hidden is None else [*parts.mtp_pages, parts.mtp_hidden]
        landing = Landing(
            message.dest_page_ids, message.dest_tags, message.layout, parts.pages,
            message.first_token_id, message.first_logprobs, message.num_cached_tokens,
            message.mtp, mtp_frames,
        )  # fmt: skip
        started = self.clock()
        refused = self.engine.land_remote(transfer.request_id, landing)
        self.peers.send(peer, m.KVAck(message.transfer_id))  # either way P may free its pages
        if refused is not None:
            self.stats.add("stale_writes_dropped")
            logger.error("transfer %r refused at landing: %s", transfer.transfer_id, refused)
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

    def _on_damaged(self, transfer: DecodeTransfer, why: str) -> None:
        self.stats.add("damaged_transfers")
        logger.warning("transfer %r arrived damaged (%s)", transfer.transfer_id, why)
        if transfer.num_resends < MAX_RESENDS:
            transfer.num_resends += 1
            self._send_to(transfer, m.KVResend(transfer.transfer_id))
            return
        error = f"kv_transfer_failed: the prompt's KV pages arrived damaged {1 + MAX_RESENDS} times"
        self.engine.fail_remote(transfer.request_id, error)
        self.stats.add("transfers_failed")
        self._abort(transfer)

    def _drop_late_pages(
        self, peer: Peer, transfer: DecodeTransfer | None, message: m.KVPages
    ) -> None:
        """Pages for a transfer that no longer waits for them: never written; P may free."""
        self.peers.send(peer, m.KVAck(message.transfer_id))
        if transfer is not None and transfer.state == DecodeState.LANDED:
            self.stats.add("duplicate_messages_dropped")
            return
        self.stats.add("late_transfers_dropped")
        logger.warning(
            "dropped late KV pages of transfer %r (%s): %d pages",
            message.transfer_id, transfer.state.value if transfer else "unknown",
            len(message.dest_page_ids),
        )  # fmt: skip
        if transfer is not None and transfer.state == DecodeState.ABORTING:
            self._close(transfer)  # P's writer is done: the pages can go

    def _on_prefill_failed(
        self, peer: Peer, transfer: DecodeTransfer | None, message: m.PrefillFailed
    ) -> None:
        if transfer is None or transfer.state in TERMINAL:
            self.stats.add("duplicate_messages_dropped")
            return
        if message.error.startswith(UNKNOWN_PEER):  # P restarted: handshake again next time
            peer.ready, peer.session, peer.deadline = False, None, 0.0
        if transfer.state == DecodeState.REQUESTED:
            self.stats.add("transfers_failed")
            self.engine.fail_remote(transfer.request_id, peer_error(message.error))
        self._close(transfer)  # P stopped: nothing is writing into the pages

    def _send_to(self, transfer: DecodeTransfer, message: m.PeerMessage) -> None:
        self.peers.send(self.peers[transfer.address], message)
