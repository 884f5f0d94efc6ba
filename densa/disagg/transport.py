"""KVTransport: how the KV agents of two workers exchange messages (headers and page frames).

The contract is deliberately weak -- messages may be lost, delayed, duplicated or reordered, and
a peer may vanish without a word -- because the state machines (decode_side.py, prefill_side.py)
must survive all of that anyway (every state has a timeout). A transport only has to deliver a
message's frames intact or not at all; damage is caught by the message's MAC regardless.

    InProcessTransport  agents in one process (tests); a hub maps addresses to inboxes
    ZmqTransport        ZeroMQ over TCP (or ipc://): P binds a ROUTER, D connects a DEALER per P

An RDMA library (NIXL, Mooncake) would sit behind the same protocol: the header messages as
they are, while KVPages' frames become a one-sided write of P's page buffers into D's page
buffers at the destination ids D sent (docs/disaggregation.md, "Other transports").
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import zmq

Frames = Sequence[bytes | memoryview]
Received = list[tuple[str, list[memoryview]]]

# Messages queued per socket and direction before more are dropped (the state machines' timeouts
# take over, as for any lost message): a peer that floods cannot grow our memory without bound.
HIGH_WATER_MARK = 1000
MAX_FRAMES = 8  # frames in one message (a header, two page buffers, an MTP state's three, the MAC)


class TransportError(ValueError):
    """An address the transport cannot use (malformed, unsupported scheme)."""


class KVTransport(Protocol):
    def listen(self, address: str | None = None) -> str:
        """Start accepting peers (at `address` if the transport takes one); returns the address
        they connect to."""
        ...

    def connect(self, address: str) -> str:
        """Reach a listening peer; returns the peer id to send to (idempotent). Raises
        TransportError for an address it cannot use."""
        ...

    def disconnect(self, peer: str) -> None:
        """Forget a peer `connect` reached (its queued messages are dropped); idempotent."""
        ...

    def send(self, peer: str, frames: Frames) -> None:
        """Queue one message for `peer`. Never blocks; may be lost (silently if the peer is
        gone)."""
        ...

    def receive(self) -> Received:
        """Every message waiting, as (peer id to answer, frames). Never blocks."""
        ...

    def waitables(self) -> list[Any]:
        """Sockets or file descriptors a zmq.Poller can wait on for new messages ([] if none)."""
        ...

    def close(self) -> None: ...


# ---- in-process ---------------------------------------------------------------------------------
class InProcessHub:
    """Mailboxes by address, for agents living in one process (tests)."""

    def __init__(self) -> None:
        self.inboxes: dict[str, deque[tuple[str, list[memoryview]]]] = {}
        self._names = itertools.count()

    def new_address(self) -> str:
        address = f"inproc-kv://{next(self._names)}"
        self.inboxes[address] = deque()
        return address


class InProcessTransport:
    def __init__(self, hub: InProcessHub) -> None:
        self.hub = hub
        self.address = hub.new_address()

    def listen(self, address: str | None = None) -> str:
        return self.address

    def connect(self, address: str) -> str:
        if not address.startswith("inproc-kv://"):
            raise TransportError("not an in-process KV address")
        return address

    def disconnect(self, peer: str) -> None:
        pass

    def send(self, peer: str, frames: Frames) -> None:
        inbox = self.hub.inboxes.get(peer)
        if inbox is not None:  # a closed peer: lost, as over a network
            # Copied, as a network would: the sender may reuse its buffers at once.
            inbox.append((self.address, [memoryview(bytes(frame)) for frame in frames]))

    def receive(self) -> Received:
        inbox = self.hub.inboxes.get(self.address)
        if not inbox:
            return []
        messages = list(inbox)
        inbox.clear()
        return messages

    def waitables(self) -> list[Any]:
        return []

    def close(self) -> None:
        self.hub.inboxes.pop(self.address, None)


# ---- ZeroMQ -------------------------------------------------------------------------------------
_ROUTER_PEER = "router:"


class ZmqTransport:
    """P binds one ROUTER (peers are told apart by their routing identity); D opens one DEALER
    per P it talks to (the agent bounds how many, and disconnects the ones it evicts).

    Bounded on every side: `max_message_bytes` (ZMQ_MAXMSGSIZE: a larger message makes ZeroMQ
    drop the connection, before it is buffered), HIGH_WATER_MARK messages per queue, and at most
    MAX_FRAMES frames per message."""

    def __init__(self, context: zmq.Context, max_message_bytes: int = 1 << 30) -> None:
        self._context = context
        self._max_message_bytes = max_message_bytes
        self._router: zmq.Socket | None = None
        self._dealers: dict[str, zmq.Socket] = {}

    def listen(self, address: str | None = None) -> str:
        router = self._socket(zmq.ROUTER)
        router.bind(address or "tcp://127.0.0.1:0")
        self._router = router
        endpoint = router.getsockopt(zmq.LAST_ENDPOINT)
        return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)

    def connect(self, address: str) -> str:
        if address not in self._dealers:
            if not address.startswith(("tcp://", "ipc://")):
                raise TransportError("a KV address must be tcp:// or ipc://")
            dealer = self._socket(zmq.DEALER)
            try:
                dealer.connect(address)
            except zmq.ZMQError as exc:
                dealer.close(linger=0)
                raise TransportError(f"cannot connect to this KV address ({exc.errno})") from exc
            self._dealers[address] = dealer
        return address

    def disconnect(self, peer: str) -> None:
        dealer = self._dealers.pop(peer, None)
        if dealer is not None:
            dealer.close(linger=0)

    def send(self, peer: str, frames: Frames) -> None:
        try:
            if peer.startswith(_ROUTER_PEER) and self._router is not None:
                identity = bytes.fromhex(peer.removeprefix(_ROUTER_PEER))
                self._router.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
            elif peer in self._dealers:
                self._dealers[peer].send_multipart(list(frames), zmq.NOBLOCK, copy=False)
        except zmq.Again:  # a high-water mark reached: lost, the timeouts take over
            pass
        except zmq.ZMQError:  # e.g. the ROUTER's peer is gone (ZMQ_ROUTER_MANDATORY): lost
            pass

    def receive(self) -> Received:
        messages: Received = []
        if self._router is not None:
            for parts in _drain(self._router):
                if 2 <= len(parts) <= MAX_FRAMES + 1:  # identity + frames
                    messages.append((_ROUTER_PEER + bytes(parts[0]).hex(), parts[1:]))
        for address, dealer in self._dealers.items():
            messages.extend((address, p) for p in _drain(dealer) if 1 <= len(p) <= MAX_FRAMES)
        return messages

    def waitables(self) -> list[Any]:
        sockets = [self._router] if self._router is not None else []
        return sockets + list(self._dealers.values())

    def close(self) -> None:
        for socket in [self._router, *self._dealers.values()]:
            if socket is not None:
                socket.close(linger=0)
        self._router, self._dealers = None, {}

    def _socket(self, kind: int) -> zmq.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
        socket.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
        socket.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        socket.setsockopt(zmq.LINGER, 0)
        return socket


def _drain(socket: zmq.Socket, limit: int = HIGH_WATER_MARK) -> list[list[memoryview]]:
    """What is waiting, up to `limit` messages (the rest waits for the next poll, so a flood
    cannot keep the engine loop here)."""
    out: list[list[memoryview]] = []
    while len(out) < limit:
        try:
            parts = socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return out
        out.append([part.buffer for part in parts])
    return out
