"""The prefill worker's side of a KV handoff: run the prompt, ship the pages, hold them until D
acknowledges (or the ack's deadline passes), so a resend can be served and nothing is freed while
D may still ask for it.

    (PrefillRequest) -> COMPUTING --first token--> HOLDING --KVAck/AbortTransfer/timeout--> RELEASED
                          |                         +--KVResend: send again, stay
                          +--AbortTransfer: stop, free, AbortAck --> RELEASED
                          +--error / timeout: free, PrefillFailed --> RELEASED

The prompt runs as an ordinary engine request with max_tokens=1 whose pages are held when it
ends (`hold_pages`), so the engine's scheduling, prefix cache and integrity checks all apply.
Released transfers stay as tombstones for a while: a duplicate PrefillRequest is not run twice.

Trust (docs/security.md): P runs prompts only for decode workers that proved they hold the cluster
secret at the handshake; every later message must carry a MAC under that handshake's session
key. Sessions, transfers in flight and resends are bounded; any exception while handling one
message fails that transfer only.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from densa.auth.frames import FrameKey, LinkKeys, Session, new_nonce
from densa.disagg import messages as m
from densa.disagg.decode_side import MAX_RESENDS, TOMBSTONE_S, UNKNOWN_PEER
from densa.disagg.handshake import mismatch
from densa.disagg.ports import PrefillEngine
from densa.disagg.stats import AgentStats
from densa.disagg.transport import KVTransport
from densa.disagg.wire import Packed
from densa.ipc.messages import RequestDelta
from densa.utils.logging import get_logger

logger = get_logger(__name__)

REQUEST_PREFIX = "pd-"  # engine request ids of remote prefills (never a front's id)
MAX_SESSIONS = 256  # decode workers with a session at once; the oldest idle one goes beyond
MAX_TRANSFERS = 1024  # transfers computing or holding at once, all peers together


class PrefillState(enum.Enum):
    COMPUTING = "computing"
    HOLDING = "holding"
    RELEASED = "released"


@dataclass
class PrefillTransfer:
    transfer_id: str
    peer_id: str
    request: m.PrefillRequest
    state: PrefillState
    deadline: float
    received_at: float
    message: m.KVPages | None = None  # what was sent, for a resend
    num_resends: int = 0

    @property
    def request_id(self) -> str:
        return REQUEST_PREFIX + self.transfer_id


class PrefillAgent:
    def __init__(
        self,
        engine: PrefillEngine,
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
        self.timeout_s = timeout_s
        self.clock = clock
        self.stats = AgentStats()
        self.transfers: dict[str, PrefillTransfer] = {}
        # Peers that passed the handshake, oldest first, with their session.
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._by_request: dict[str, str] = {}

    # ---- entry points ----------------------------------------------------------------------------
    def poll(self) -> bool:
        """Take every message in, then fire due deadlines. Returns whether anything happened."""
        received = self.transport.receive()
        for peer_id, frames in received:
            self._receive(peer_id, frames)
        now = self.clock()
        due = [t for t in self.transfers.values() if now > t.deadline]
        for transfer in due:
            self._on_deadline(transfer)
        return bool(received or due)

    def take_outputs(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """Consume the engine outputs of remote prefills; return everyone else's."""
        others = []
        for delta in deltas:
            transfer_id = self._by_request.get(delta.request_id)
            if transfer_id is None:
                others.append(delta)
            elif delta.finished:
                self._on_finished(self.transfers[transfer_id], delta)
        return others

    def is_busy(self) -> bool:
        return any(t.state != PrefillState.RELEASED for t in self.transfers.values())

    def gauges(self) -> dict[str, int]:
        counts = {"in_computing": 0, "in_holding": 0}
        for transfer in self.transfers.values():
            if transfer.state != PrefillState.RELEASED:
                counts[f"in_{transfer.state.value}"] += 1
        return counts

    # ---- the state machine -----------------------------------------------------------------------
    def _on_request(self, peer_id: str, request: m.PrefillRequest) -> None:
        if request.transfer_id in self.transfers:
            self.stats.add("duplicate_messages_dropped")
            return
        now = self.clock()
        transfer = PrefillTransfer(
            request.transfer_id, peer_id, request, PrefillState.COMPUTING, now + self.timeout_s, now
        )
        self.transfers[request.transfer_id] = transfer
        error = self._refusal(peer_id, request) or self.engine.start_prefill(
            transfer.request_id, request
        )
        if error is not None:
            self._fail(transfer, error)
            return
        self._by_request[transfer.request_id] = transfer.transfer_id
        self.stats.add("transfers_started")

    def _refusal(self, peer_id: str, request: m.PrefillRequest) -> str | None:
        if self._num_live() > MAX_TRANSFERS:
            return "kv_transfer_failed: the prefill worker has too many transfers in flight"
        page_size = self.model.page.page_size
        num_blocks = -(-len(request.prompt_token_ids) // page_size)
        if (
            not 0 <= request.first_block <= num_blocks
            or num_blocks - request.first_block != len(request.dest_page_ids)
            or len(request.dest_page_ids) != len(request.dest_tags)
        ):
            return (
                f"kv_transfer_failed: {len(request.dest_page_ids)} destination pages for blocks "
                f"{request.first_block}..{num_blocks} of the prompt"
            )
        return None

    def _on_finished(self, transfer: PrefillTransfer, delta: RequestDelta) -> None:
        self._by_request.pop(transfer.request_id, None)
        if transfer.state != PrefillState.COMPUTING:
            self.engine.release_held(transfer.request_id)
            return
        held = self.engine.held_page_ids(transfer.request_id)
        if delta.finish_reason == "error" or not delta.new_token_ids or held is None:
            self._fail(transfer, delta.error or "kv_transfer_failed: the prefill produced no token")
            return
        started = self.clock()
        request = transfer.request
        packed = self.engine.pack(transfer.request_id, held[request.first_block :], request)
        self.stats.add("pack_ms", 1000 * (self.clock() - started))
        transfer.message = m.KVPages(
            transfer_id=transfer.transfer_id,
            dest_page_ids=request.dest_page_ids,
            dest_tags=request.dest_tags,
            layout=packed.layout,
            first_token_id=delta.new_token_ids[0],
            first_logprobs=delta.new_logprobs[0] if delta.new_logprobs else None,
            num_cached_tokens=delta.num_cached_tokens,
            prefill_ms=1000 * (self.clock() - transfer.received_at),
            mtp=packed.mtp,
        )
        self._send_pages(transfer, packed)
        self._enter(transfer, PrefillState.HOLDING)

    def _send_pages(self, transfer: PrefillTransfer, packed: Packed) -> None:
        assert transfer.message is not None
        self.stats.add("pages", len(transfer.request.dest_page_ids))
        self.stats.add("bytes", packed.num_bytes)
        session = self._sessions.get(transfer.peer_id)
        if session is None:  # the session was evicted: D's timeout decides
            return
        frames: list[bytes | memoryview] = [m.encode(transfer.message), *packed.frames]
        started = self.clock()
        mac = session.to_decode.seal(frames)
        self.stats.add("mac_ms", 1000 * (self.clock() - started))
        self.transport.send(transfer.peer_id, [*frames, mac])

    def _on_resend(self, transfer: PrefillTransfer) -> None:
        held = self.engine.held_page_ids(transfer.request_id)
        if transfer.state != PrefillState.HOLDING or held is None:
            self.stats.add("duplicate_messages_dropped")
            return
        if transfer.num_resends >= MAX_RESENDS:  # D asks at most that often: more is a flood
            self.stats.add("resends_refused")
            return
        transfer.num_resends += 1
        self.stats.add("resends")
        request = transfer.request
        packed = self.engine.pack(transfer.request_id, held[request.first_block :], request)
        message = transfer.message
        assert message is not None
        transfer.message = msgspec.structs.replace(message, layout=packed.layout, mtp=packed.mtp)
        self._send_pages(transfer, packed)

    def _on_abort(self, transfer: PrefillTransfer) -> None:
        if transfer.state == PrefillState.RELEASED:
            self._send(transfer.peer_id, m.AbortAck(transfer.transfer_id))
            return
        self.stats.add("transfers_aborted")
        if transfer.state == PrefillState.COMPUTING:
            self._by_request.pop(transfer.request_id, None)
            self.engine.abort(transfer.request_id)
        self._release(transfer)
        self._send(transfer.peer_id, m.AbortAck(transfer.transfer_id))

    def _on_deadline(self, transfer: PrefillTransfer) -> None:
        if transfer.state == PrefillState.RELEASED:
            del self.transfers[transfer.transfer_id]
            return
        self.stats.add("timeouts")
        if transfer.state == PrefillState.HOLDING:
            self.stats.add("ack_timeouts")
            logger.warning("no ack for transfer %s: its pages are freed", transfer.transfer_id)
            self._release(transfer)
            return
        self._by_request.pop(transfer.request_id, None)
        self.engine.abort(transfer.request_id)
        self._fail(transfer, f"kv_transfer_timeout: the prefill took over {self.timeout_s:g} s")

    def _fail(self, transfer: PrefillTransfer, error: str) -> None:
        self.stats.add("transfers_failed")
        self._release(transfer)
        self._send(transfer.peer_id, m.PrefillFailed(transfer.transfer_id, error))

    def _release(self, transfer: PrefillTransfer) -> None:
        self.engine.release_held(transfer.request_id)
        self._enter(transfer, PrefillState.RELEASED)

    def _enter(self, transfer: PrefillTransfer, state: PrefillState) -> None:
        transfer.state = state
        linger = TOMBSTONE_S if state == PrefillState.RELEASED else self.timeout_s
        transfer.deadline = self.clock() + linger

    # ---- messages --------------------------------------------------------------------------------
    def _receive(self, peer_id: str, frames: list[memoryview]) -> None:
        message = self._authentic(peer_id, frames)
        if message is None:
            return
        try:
            self._dispatch(peer_id, message, frames)
        except Exception:  # confined: this message's transfer fails, the worker goes on
            self.stats.add("peer_faults")
            logger.exception("handling a %s from %r failed", type(message).__name__, peer_id)
            transfer = self.transfers.get(getattr(message, "transfer_id", ""))
            if transfer is not None and transfer.state != PrefillState.RELEASED:
                self._by_request.pop(transfer.request_id, None)
                self.engine.abort(transfer.request_id)
                self._fail(transfer, "kv_transfer_failed: the prefill worker could not run it")

    def _authentic(self, peer_id: str, frames: list[memoryview]) -> m.PeerMessage | None:
        """The message if it verifies under this peer's session, or is a hello under the hello
        key; else None (a request from a peer we have no session with is told so)."""
        session = self._sessions.get(peer_id)
        is_hello = False
        if session is None or not session.to_prefill.verify(frames):
            is_hello = self.keys.hello().verify(frames)
            if not is_hello:
                self._on_unauthentic(peer_id, frames, session is None)
                return None
        message = m.decode_or_none(frames)
        if message is None:
            self.stats.add("undecodable_messages")
            logger.warning("dropped an undecodable message from %r", peer_id)
            return None
        if is_hello != isinstance(message, m.PeerHello):
            self.stats.add("unauthenticated_messages")
            return None
        return message

    def _on_unauthentic(self, peer_id: str, frames: list[memoryview], unknown: bool) -> None:
        self.stats.add("unauthenticated_messages")
        claimed = m.decode_or_none(frames)  # only to answer it, never acted on
        if unknown and isinstance(claimed, m.PrefillRequest):
            # Most likely this worker restarted and its peer still has the old session: say so
            # (the answer reveals nothing and changes nothing but a fresh handshake).
            error = f"{UNKNOWN_PEER}: no handshake from this decode worker (the prefill restarted?)"
            reply = m.PrefillFailed(claimed.transfer_id, error)
            self._send(peer_id, reply, self.keys.unknown_peer())
            return
        logger.warning("dropped a message from %r that fails its MAC", peer_id)

    def _dispatch(self, peer_id: str, message: m.PeerMessage, frames: list[memoryview]) -> None:
        if isinstance(message, m.PeerHello):
            self._on_hello(peer_id, message)
        elif isinstance(message, m.PrefillRequest):
            self._on_request(peer_id, message)
        elif isinstance(message, m.KVAck | m.KVResend | m.AbortTransfer):
            transfer = self.transfers.get(message.transfer_id)
            if transfer is None or transfer.peer_id != peer_id:  # bound to the peer that asked
                self.stats.add("duplicate_messages_dropped")
            elif isinstance(message, m.KVAck):
                if transfer.state == PrefillState.HOLDING:
                    self._release(transfer)
                else:
                    self.stats.add("duplicate_messages_dropped")
            elif isinstance(message, m.KVResend):
                self._on_resend(transfer)
            else:
                self._on_abort(transfer)

    def _on_hello(self, peer_id: str, hello: m.PeerHello) -> None:
        error = mismatch(self.model, hello.model) or self._make_room_for(peer_id)
        nonce = new_nonce()
        if error is None:
            self._sessions.pop(peer_id, None)
            self._sessions[peer_id] = self.keys.session(hello.nonce, nonce)
        else:
            self.stats.add("handshake_failures")
            logger.error("refused decode worker %r: %s", peer_id, error)
        welcome = m.PeerWelcome(self.model, nonce, error)
        self._send(peer_id, welcome, self.keys.welcome(hello.nonce))

    def _make_room_for(self, peer_id: str) -> str | None:
        """Evict the oldest session no live transfer uses, once MAX_SESSIONS exist."""
        if peer_id in self._sessions or len(self._sessions) < MAX_SESSIONS:
            return None
        busy = {t.peer_id for t in self.transfers.values() if t.state != PrefillState.RELEASED}
        idle = next((p for p in self._sessions if p not in busy), None)
        if idle is None:
            return "kv_peer_refused: the prefill worker has no room for another decode worker"
        del self._sessions[idle]
        return None

    def _num_live(self) -> int:
        return sum(1 for t in self.transfers.values() if t.state != PrefillState.RELEASED)

    def _send(self, peer_id: str, message: m.PeerMessage, key: FrameKey | None = None) -> None:
        if key is None:
            session = self._sessions.get(peer_id)
            if session is None:  # evicted or never shaken hands: the peer's timeouts decide
                return
            key = session.to_decode
        frames = [m.encode(message)]
        self.transport.send(peer_id, [*frames, key.seal(frames)])
