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
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from densa.disagg import messages as m
from densa.disagg.decode_side import TOMBSTONE_S, UNKNOWN_PEER
from densa.disagg.handshake import mismatch
from densa.disagg.ports import PrefillEngine
from densa.disagg.stats import AgentStats
from densa.disagg.transport import KVTransport
from densa.disagg.wire import Packed
from densa.ipc.messages import RequestDelta
from densa.utils.logging import get_logger

logger = get_logger(__name__)

REQUEST_PREFIX = "pd-"  # engine request ids of remote prefills (never a front's id)


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
    ) -> None:
        self.engine = engine
        self.transport = transport
        self.model = model
        self.timeout_s = timeout_s
        self.clock = clock
        self.stats = AgentStats()
        self.transfers: dict[str, PrefillTransfer] = {}
        self._peers: set[str] = set()  # peers that passed the handshake
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
        if peer_id not in self._peers:
            return f"{UNKNOWN_PEER}: no handshake from this decode worker (the prefill restarted?)"
        page_size = self.model.page.page_size
        num_blocks = -(-len(request.prompt_token_ids) // page_size)
        if num_blocks - request.first_block != len(request.dest_page_ids) or len(
            request.dest_page_ids
        ) != len(request.dest_tags):
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
        packed = self.engine.pack(held[request.first_block :])
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
        )
        self._send_pages(transfer, packed)
        self._enter(transfer, PrefillState.HOLDING)

    def _send_pages(self, transfer: PrefillTransfer, packed: Packed) -> None:
        assert transfer.message is not None
        self.stats.add("pages", len(transfer.request.dest_page_ids))
        self.stats.add("bytes", packed.num_bytes)
        self.transport.send(transfer.peer_id, [m.encode(transfer.message), *packed.frames])

    def _on_resend(self, transfer: PrefillTransfer) -> None:
        held = self.engine.held_page_ids(transfer.request_id)
        if transfer.state != PrefillState.HOLDING or held is None:
            self.stats.add("duplicate_messages_dropped")
            return
        self.stats.add("resends")
        packed = self.engine.pack(held[transfer.request.first_block :])
        message = transfer.message
        assert message is not None
        transfer.message = msgspec.structs.replace(message, layout=packed.layout)
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
        try:
            message = m.decode(frames[0])
        except (m.DecodeError, IndexError):
            self.stats.add("undecodable_messages")
            logger.warning("dropped an undecodable message from %s", peer_id)
            return
        if isinstance(message, m.PeerHello):
            self._on_hello(peer_id, message)
        elif isinstance(message, m.PrefillRequest):
            self._on_request(peer_id, message)
        elif isinstance(message, m.KVAck | m.KVResend | m.AbortTransfer):
            transfer = self.transfers.get(message.transfer_id)
            if transfer is None:
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
        error = mismatch(self.model, hello.model)
        if error is None:
            self._peers.add(peer_id)
        else:
            self.stats.add("handshake_failures")
            logger.error("refused decode worker %s: %s", peer_id, error)
        self._send(peer_id, m.PeerWelcome(self.model, error))

    def _send(self, peer_id: str, message: m.PeerMessage) -> None:
        self.transport.send(peer_id, [m.encode(message)])
