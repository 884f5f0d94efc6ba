"""KVTransport: how the KV agents of two workers exchange messages (headers and page frames).

The contract is deliberately weak -- messages may be lost, delayed, duplicated or reordered, and
a peer may vanish without a word -- because the state machines (decode_side.py, prefill_side.py)
must survive all of that anyway (every state has a timeout). A transport only has to deliver a
message's frames intact or not at all; damage is caught by the frames' checksums regardless.

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


class KVTransport(Protocol):
    def listen(self, address: str | None = None) -> str:
        """Start accepting peers (at `address` if the transport takes one); returns the address
        they connect to."""
        ...

    def connect(self, address: str) -> str:
        """Reach a listening peer; returns the peer id to send to (idempotent)."""
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
        return address

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
    per P it talks to. Queues are bounded by the requests in flight, so no high-water mark."""

    def __init__(self, context: zmq.Context) -> None:
        self._context = context
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
            dealer = self._socket(zmq.DEALER)
            dealer.connect(address)
            self._dealers[address] = dealer
        return address

    def send(self, peer: str, frames: Frames) -> None:
        try:
            if peer.startswith(_ROUTER_PEER) and self._router is not None:
                identity = bytes.fromhex(peer.removeprefix(_ROUTER_PEER))
                self._router.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
            elif peer in self._dealers:
                self._dealers[peer].send_multipart(list(frames), zmq.NOBLOCK, copy=False)
        except zmq.Again:  # only with a high-water mark reached: lost, the timeouts take over
            pass

    def receive(self) -> Received:
        messages: Received = []
        if self._router is not None:
            for parts in _drain(self._router):
                peer = _ROUTER_PEER + bytes(parts[0]).hex()
                messages.append((peer, parts[1:]))
        for address, dealer in self._dealers.items():
            messages.extend((address, parts) for parts in _drain(dealer))
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
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        return socket


def _drain(socket: zmq.Socket) -> list[list[memoryview]]:
    out: list[list[memoryview]] = []
    while True:
        try:
            parts = socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return out
        out.append([part.buffer for part in parts])
