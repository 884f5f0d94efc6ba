"""Hostile and honest peers for the KV agents, without engines: fake engines behind the agents'
ports (exact calls recorded), a hand-driven peer that speaks the protocol with or without the
cluster secret, and page frames built by hand."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from densa.auth.frames import FrameKey, LinkKeys, Session, new_nonce
from densa.auth.secret import ClusterSecret
from densa.disagg import messages as m
from densa.disagg.decode_side import DecodeAgent
from densa.disagg.handshake import expected_page_bytes
from densa.disagg.ports import Landing, Reservation
from densa.disagg.prefill_side import PrefillAgent
from densa.disagg.transport import InProcessHub, InProcessTransport
from densa.disagg.wire import Packed
from densa.sampling_params import SamplingParams
from tests.disagg.support import FakeClock

SECRET = ClusterSecret(b"the-cluster-secret-of-these-tests")
ATTACKER_SECRET = ClusterSecret(b"a-secret-the-attacker-made-up!!!")
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, VOCAB = 2, 2, 8, 16, 100
ARCH: dict[str, Any] = {
    "architecture": "llama", "vocab_size": VOCAB, "hidden_size": 32, "num_layers": NUM_LAYERS,
    "num_heads": 4, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "rope_theta": 10000.0,
    "max_position_embeddings": 512, "moe": None, "mla": None,
}  # fmt: skip
PROMPT = list(range(1, 21))  # 20 tokens: 2 pages
DEST_PAGE_IDS, DEST_TAGS = [7, 9], [3, 5]


def peer_model(role: str) -> m.PeerModel:
    page = m.PageFormat("float32", "none", PAGE_SIZE, 0)
    page = m.PageFormat("float32", "none", PAGE_SIZE, expected_page_bytes(ARCH, page))
    return m.PeerModel(ARCH, "tokenizer-digest", page, role, "dense")


def page_frames(
    num_pages: int = 2, shape: list[int] | None = None
) -> tuple[m.WireLayout, list[bytes]]:
    """Float32 pages as the wire carries them (values = the index of each value, mod 251)."""
    shape = shape or [NUM_LAYERS, 2, num_pages, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM]
    num_values = 1
    for size in shape:
        num_values *= size
    values = bytes(i % 251 for i in range(num_values * 4))
    layout = m.WireLayout("float32", "none", shape)
    return layout, [values]


@dataclass
class FakeDecodeEngine:
    """The decode worker's engine as its agent sees it, recording every call."""

    receiving: set[str] = field(default_factory=set)
    landed: dict[str, Landing] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)
    raise_on_land: bool = False

    def is_receiving(self, request_id: str) -> bool:
        return request_id in self.receiving

    def reserve_remote(self, request_id: str) -> Reservation | None:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        return Reservation(0, DEST_PAGE_IDS, DEST_TAGS, PROMPT, params, "tenant-a")

    def land_remote(self, request_id: str, landing: Landing) -> str | None:
        if self.raise_on_land:
            raise IndexError("a bug in landing")
        self.landed[request_id] = landing
        self.receiving.discard(request_id)
        return None

    def fail_remote(self, request_id: str, error: str) -> None:
        self.failed[request_id] = error
        self.receiving.discard(request_id)

    def release_held(self, request_id: str) -> None:
        self.released.append(request_id)


@dataclass
class FakePrefillEngine:
    started: dict[str, m.PrefillRequest] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    num_packs: int = 0
    raise_on_start: bool = False

    def start_prefill(self, request_id: str, request: m.PrefillRequest) -> str | None:
        if self.raise_on_start:
            raise RuntimeError("a bug in the engine")
        self.started[request_id] = request
        return None

    def held_page_ids(self, request_id: str) -> list[int] | None:
        return [0, 1] if request_id in self.started else None

    def pack(self, request_id: str, page_ids: list[int], request: m.PrefillRequest) -> Packed:
        self.num_packs += 1
        layout, frames = page_frames(len(page_ids))
        return Packed(layout, [memoryview(f) for f in frames])

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def release_held(self, request_id: str) -> None:
        self.released.append(request_id)


class HandPeer:
    """A peer driven by the test, message by message, holding `secret` (or a wrong one)."""

    def __init__(self, hub: InProcessHub, role: str, secret: ClusterSecret) -> None:
        self.transport = InProcessTransport(hub)
        self.address = self.transport.listen()
        self.keys = LinkKeys(secret)
        self.model = peer_model(role)
        self.nonce = new_nonce()
        self.session: Session | None = None
        self.inbox: list[tuple[str, list[memoryview]]] = []

    def send(self, to: str, message: m.PeerMessage, key: FrameKey | None,
             extra: list[bytes] | None = None) -> None:  # fmt: skip
        frames: list[bytes | memoryview] = [m.encode(message), *(extra or [])]
        mac = [key.seal(frames)] if key is not None else [b"\0" * 32]
        self.transport.send(to, [*frames, *mac])

    def send_raw(self, to: str, frames: list[bytes]) -> None:
        self.transport.send(to, frames)

    def receive(self) -> list[m.PeerMessage]:
        received = self.transport.receive()
        self.inbox += received
        return [m.decode(frames[0]) for _, frames in received]

    # ---- as a prefill worker, answering a decode agent's hello
    def welcome(self, hello_frames: list[memoryview], to: str) -> None:
        hello = m.decode(hello_frames[0])
        assert isinstance(hello, m.PeerHello)
        nonce = new_nonce()
        self.send(to, m.PeerWelcome(self.model, nonce), self.keys.welcome(hello.nonce))
        self.session = self.keys.session(hello.nonce, nonce)

    # ---- as a decode worker, shaking hands with a prefill agent
    def hello(self, to: str) -> None:
        self.send(to, m.PeerHello(self.model, self.nonce), self.keys.hello())

    def on_welcome(self, frames: list[memoryview]) -> None:
        welcome = m.decode(frames[0])
        assert isinstance(welcome, m.PeerWelcome) and welcome.error is None
        self.session = self.keys.session(self.nonce, welcome.nonce)


@dataclass
class DecodeSide:
    """A real DecodeAgent over a fake engine, and the hub its peers join."""

    hub: InProcessHub
    engine: FakeDecodeEngine
    agent: DecodeAgent
    clock: FakeClock

    def start(self, request_id: str, address: str) -> None:
        self.engine.receiving.add(request_id)
        self.agent.start(request_id, address)


def decode_side(secret: ClusterSecret = SECRET) -> DecodeSide:
    hub, clock, engine = InProcessHub(), FakeClock(), FakeDecodeEngine()
    agent = DecodeAgent(engine, InProcessTransport(hub), peer_model("decode"), timeout_s=5.0,
                        clock=clock, keys=LinkKeys(secret))  # fmt: skip
    return DecodeSide(hub, engine, agent, clock)


@dataclass
class PrefillSide:
    hub: InProcessHub
    engine: FakePrefillEngine
    agent: PrefillAgent
    address: str
    clock: FakeClock


def prefill_side(secret: ClusterSecret = SECRET) -> PrefillSide:
    hub, clock, engine = InProcessHub(), FakeClock(), FakePrefillEngine()
    transport = InProcessTransport(hub)
    agent = PrefillAgent(engine, transport, peer_model("prefill"), timeout_s=5.0, clock=clock,
                         keys=LinkKeys(secret))  # fmt: skip
    return PrefillSide(hub, engine, agent, transport.listen(), clock)
