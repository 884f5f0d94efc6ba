"""The prefill workers a decode agent is connected to, by address: each with its half of the
session key until the handshake completes, then the session itself. At most MAX_PEERS are
connected at once; the oldest one no live transfer uses makes room for a new one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from densa.auth.frames import FrameKey, LinkKeys, Session, new_nonce
from densa.disagg import messages as m
from densa.disagg.handshake import mismatch
from densa.disagg.stats import AgentStats
from densa.disagg.transport import KVTransport, TransportError
from densa.utils.logging import get_logger

logger = get_logger(__name__)

MAX_PEERS = 64  # prefill workers connected at once; idle ones are disconnected beyond that


@dataclass
class Peer:
    address: str
    peer_id: str
    nonce: bytes  # our half of the session key, sent in PeerHello
    session: Session | None = None  # set by an authentic, accepting PeerWelcome
    ready: bool = False
    error: str | None = None
    deadline: float = 0.0


@dataclass
class DecodePeers:
    """Connections and sends; which transfer a peer serves is the agent's business."""

    transport: KVTransport
    model: m.PeerModel
    keys: LinkKeys
    timeout_s: float
    clock: Callable[[], float]
    stats: AgentStats
    _by_address: dict[str, Peer] = field(default_factory=dict)  # oldest first

    def __len__(self) -> int:
        return len(self._by_address)

    def __getitem__(self, address: str) -> Peer:
        return self._by_address[address]

    def connect(self, address: str, in_use: Callable[[], set[str]]) -> Peer:
        """The peer at `address`, saying hello first where there is none yet (or it refused or
        stayed silent past its deadline: it may have been replaced). `in_use`: the addresses
        live transfers use, which are never disconnected to make room."""
        peer = self._by_address.get(address)
        if peer is None or (not peer.ready and self.clock() > peer.deadline):
            if peer is None:
                self._make_room(in_use)
            peer = Peer(address, self.transport.connect(address), new_nonce())
            peer.deadline = self.clock() + self.timeout_s
            self._by_address[address] = peer
            self.send(peer, m.PeerHello(self.model, peer.nonce), self.keys.hello())
        return peer

    def _make_room(self, in_use: Callable[[], set[str]]) -> None:
        """Disconnect the oldest peer no live transfer uses, once MAX_PEERS are connected."""
        if len(self._by_address) < MAX_PEERS:
            return
        busy = in_use()
        idle = next((a for a in self._by_address if a not in busy), None)
        if idle is None:
            raise TransportError(f"all {MAX_PEERS} prefill worker connections are in use")
        self.transport.disconnect(self._by_address.pop(idle).peer_id)

    def by_id(self, peer_id: str) -> Peer | None:
        return next((p for p in self._by_address.values() if p.peer_id == peer_id), None)

    def send(self, peer: Peer, message: m.PeerMessage, key: FrameKey | None = None) -> None:
        """Seal `message` under `key`, else under the peer's session (none: not sent)."""
        if key is None:
            if peer.session is None:  # the session is gone (P restarted): the timeouts decide
                return
            key = peer.session.to_prefill
        frames = [m.encode(message)]
        self.transport.send(peer.peer_id, [*frames, key.seal(frames)])

    def welcome(self, peer: Peer, welcome: m.PeerWelcome) -> None:
        """The handshake's answer: a session, or the reason the peer refused (asked again
        after a second: it may be replaced)."""
        peer.error = mismatch(self.model, welcome.model) or welcome.error
        peer.ready = peer.error is None
        if peer.error:
            self.stats.add("handshake_failures")
            logger.error("prefill worker %r refused: %r", peer.address, peer.error)
            peer.deadline = self.clock() + 1.0
        else:
            peer.session = self.keys.session(peer.nonce, welcome.nonce)
            logger.info("prefill worker %r: %r", peer.address, welcome.model.weight_format)

    def verify(self, peer: Peer, frames: list[memoryview]) -> bool:
        """Whether the MAC verifies under this peer's session (or, before the session, under
        the welcome key of our hello); the time it takes is counted."""
        key = peer.session.to_decode if peer.session else self.keys.welcome(peer.nonce)
        started = self.clock()
        authentic = key.verify(frames)
        self.stats.add("mac_ms", 1000 * (self.clock() - started))
        return authentic

    def decode(self, peer: Peer, frames: list[memoryview]) -> m.PeerMessage | None:
        """An authentic message, if it is one and fits the handshake's stage; None (counted)."""
        message = m.decode_or_none(frames)
        if message is None:
            self.stats.add("undecodable_messages")
            logger.warning("dropped an undecodable message from %r", peer.address)
            return None
        if isinstance(message, m.PeerWelcome) != (peer.session is None):
            self.stats.add("duplicate_messages_dropped")  # a second welcome, or none yet
            return None
        return message
