"""No peer can hurt a worker (issue 20): the KV agents against hostile peers, message by message.

Each test drives a real agent (DecodeAgent or PrefillAgent) over the in-process transport, with a
fake engine recording exactly what the agent asked of it, and a peer the test controls: one
without the cluster secret (an outsider who reached the port), or one with it that sends what a
faulty or compromised member could (wrong layouts, tokens, counts, floods, nested messages)."""

from __future__ import annotations

from typing import Any, cast

import msgspec
import pytest
import zmq

from densa.disagg import messages as m
from densa.disagg.decode_peers import MAX_PEERS
from densa.disagg.decode_side import MAX_RESENDS
from densa.disagg.decode_transfer import DecodeState
from densa.disagg.transport import InProcessHub, InProcessTransport, TransportError, ZmqTransport
from densa.engine.disagg_port import KVAgents
from densa.ipc.messages import RequestDelta
from tests.disagg.peers import (
    ATTACKER_SECRET,
    DEST_PAGE_IDS,
    DEST_TAGS,
    NUM_KV_HEADS,
    NUM_LAYERS,
    PAGE_SIZE,
    PROMPT,
    SECRET,
    VOCAB,
    DecodeSide,
    HandPeer,
    decode_side,
    page_frames,
    prefill_side,
)


# ---- the decode side: who may answer, and what an answer may say --------------------------------
def handshake(side: DecodeSide, peer: HandPeer, request_id: str = "r1") -> m.PrefillRequest:
    """Start a transfer at `peer`, answer the hello, return the PrefillRequest D sent."""
    side.start(request_id, peer.address)
    ((_, hello),) = peer.transport.receive()
    peer.welcome(hello, side.agent.transport.address)  # type: ignore[attr-defined]
    side.agent.poll()
    (request,) = peer.receive()
    assert isinstance(request, m.PrefillRequest)
    return request


def send_pages(
    side: DecodeSide, peer: HandPeer, request: m.PrefillRequest, **changes: object
) -> None:
    layout, frames = page_frames()
    fields = dict(transfer_id=request.transfer_id, dest_page_ids=request.dest_page_ids,
                  dest_tags=request.dest_tags, layout=layout, first_token_id=5,
                  first_logprobs=None, num_cached_tokens=0, prefill_ms=1.0)  # fmt: skip
    fields.update(changes)
    pages = m.KVPages(**fields)  # type: ignore[arg-type]
    assert peer.session is not None
    frames_out = [m.encode(pages), *frames]
    peer.transport.send(side.agent.transport.address,  # type: ignore[attr-defined]
                        [*frames_out, peer.session.to_decode.seal(frames_out)])  # fmt: skip
    side.agent.poll()


def test_an_honest_peer_with_the_secret_lands_exactly_the_reserved_pages() -> None:
    side, peer = decode_side(), None
    peer = HandPeer(side.hub, "prefill", SECRET)
    request = handshake(side, peer)
    assert (request.dest_page_ids, request.dest_tags, request.cache_scope) == (
        DEST_PAGE_IDS, DEST_TAGS, "tenant-a")  # fmt: skip
    send_pages(side, peer, request)
    landing = side.engine.landed["r1"]
    assert (landing.dest_page_ids, landing.dest_tags, landing.first_token_id) == (
        DEST_PAGE_IDS, DEST_TAGS, 5)  # fmt: skip
    assert side.agent.transfers[request.transfer_id].state == DecodeState.LANDED
    assert isinstance(peer.receive()[0], m.KVAck)


def test_a_peer_without_the_secret_never_gets_a_session_or_lands_a_byte() -> None:
    side = decode_side()
    outsider = HandPeer(side.hub, "prefill", ATTACKER_SECRET)
    side.start("r1", outsider.address)
    ((_, hello),) = outsider.transport.receive()
    outsider.welcome(hello, side.agent.transport.address)  # echoes our own model, as in the attack
    side.agent.poll()
    assert outsider.receive() == []  # no PrefillRequest: the prompt never left
    assert side.agent.stats.counts["unauthenticated_messages"] == 1
    # It cannot skip the handshake either: pages sealed under its own "session" are dropped.
    send_pages(side, outsider, m.PrefillRequest("r1#0", PROMPT, m.SamplingParams(), "tenant-a",
                                                0, DEST_PAGE_IDS, DEST_TAGS))  # fmt: skip
    assert side.engine.landed == {}
    side.clock.now += 6
    side.agent.poll()
    assert side.engine.failed["r1"].startswith("kv_transfer_timeout")


def test_a_stranger_writing_to_the_decode_port_is_ignored() -> None:
    side = decode_side()
    peer = HandPeer(side.hub, "prefill", SECRET)
    request = handshake(side, peer)
    stranger = HandPeer(side.hub, "prefill", SECRET)  # even holding the secret: not asked
    stranger.session = peer.session  # and replaying the real peer's session key
    send_pages(side, stranger, request, first_token_id=7)
    assert side.engine.landed == {} and side.agent.stats.counts["unauthenticated_messages"] == 1
    send_pages(side, peer, request)
    assert side.engine.landed["r1"].first_token_id == 5


def test_only_the_peer_that_was_asked_may_answer_a_transfer() -> None:
    side = decode_side()
    asked, other = HandPeer(side.hub, "prefill", SECRET), HandPeer(side.hub, "prefill", SECRET)
    request = handshake(side, asked, "r1")
    handshake(side, other, "r2")
    send_pages(side, other, request)  # a member answering for a transfer it was not asked
    assert "r1" not in side.engine.landed
    assert side.agent.stats.counts["misdirected_messages"] == 1


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"first_token_id": VOCAB}, "first token outside the vocabulary"),
        ({"first_token_id": -1}, "first token outside the vocabulary"),
        ({"num_cached_tokens": len(PROMPT) + 1}, "more cached tokens"),
        ({"num_cached_tokens": -1}, "more cached tokens"),
        ({"dest_page_ids": [7, 8]}, "other destinations"),
        ({"dest_tags": [3, 6]}, "other destinations"),
        ({"first_logprobs": m.TokenLogprobs(5, -0.1, [(VOCAB + 9, -1.0)])}, "logprobs"),
    ],
)
def test_authentic_values_that_do_not_fit_fail_only_that_transfer(
    changes: dict[str, object], why: str
) -> None:
    side = decode_side()
    peer = HandPeer(side.hub, "prefill", SECRET)
    request = handshake(side, peer)
    send_pages(side, peer, request, **changes)
    assert side.engine.landed == {}
    assert why in side.engine.failed["r1"]
    assert side.engine.released == ["r1"]  # the destination pages are freed at once
    assert isinstance(peer.receive()[0], m.KVAck)  # and P may free its own
    assert side.agent.stats.counts["invalid_pages"] == 1
    # The worker goes on: the next transfer from the same peer lands.
    send_pages(side, peer, handshake_again(side, peer, "r2"))
    assert "r2" in side.engine.landed


def handshake_again(side: DecodeSide, peer: HandPeer, request_id: str) -> m.PrefillRequest:
    side.start(request_id, peer.address)
    (request,) = [r for r in peer.receive() if isinstance(r, m.PrefillRequest)]
    return request


@pytest.mark.parametrize(
    "shape",
    [
        [NUM_LAYERS + 1, 2, 2, NUM_KV_HEADS, PAGE_SIZE, 8],  # a layer more than the model
        [NUM_LAYERS, 2, 2, NUM_KV_HEADS * 2, PAGE_SIZE, 4],  # same bytes, other heads
        [NUM_LAYERS, 2, 2, NUM_KV_HEADS, PAGE_SIZE],  # a dimension short
        [NUM_LAYERS, 2, 3, NUM_KV_HEADS, PAGE_SIZE, 8],  # a page more than reserved
    ],
)
def test_a_layout_that_does_not_match_the_local_model_is_refused_not_landed(
    shape: list[int],
) -> None:
    side = decode_side()
    peer = HandPeer(side.hub, "prefill", SECRET)
    request = handshake(side, peer)
    layout, _ = page_frames(shape=shape)
    send_pages(side, peer, request, layout=layout)
    assert side.engine.landed == {} and "unusable pages" in side.engine.failed["r1"]


def test_damage_in_flight_is_resent_a_bounded_number_of_times() -> None:
    side = decode_side()
    peer = HandPeer(side.hub, "prefill", SECRET)
    request = handshake(side, peer)
    layout, frames = page_frames()
    pages = m.KVPages(request.transfer_id, DEST_PAGE_IDS, DEST_TAGS, layout, 5, None, 0, 1.0)
    assert peer.session is not None
    header = m.encode(pages)
    mac = peer.session.to_decode.seal([header, *frames])
    damaged = bytearray(frames[0])
    damaged[10] ^= 0xFF
    for _ in range(MAX_RESENDS + 1):
        peer.send_raw(side.agent.transport.address, [header, bytes(damaged), mac])  # type: ignore[attr-defined]
        side.agent.poll()
    kinds = [type(message).__name__ for message in peer.receive()]
    assert kinds == ["KVResend"] * MAX_RESENDS + ["AbortTransfer"]
    assert "damaged" in side.engine.failed["r1"] and side.engine.landed == {}


def nested(depth: int) -> bytes:
    """A msgpack value nested `depth` arrays deep, as a PeerModel.architecture value."""
    return b"\x91" * depth + b"\x01"


def test_deeply_nested_and_oversized_messages_are_dropped_without_an_exception() -> None:
    side = decode_side()
    peer = HandPeer(side.hub, "prefill", SECRET)
    handshake(side, peer)
    assert peer.session is not None
    hostile = [
        b"\x82\xa4type\xabPeerWelcome\xa5model" + nested(100_000),
        msgspec.msgpack.encode({"type": "KVPages", "transfer_id": "x" * 10_000}),
        msgspec.msgpack.encode({"type": "PrefillFailed", "transfer_id": "r1#0", "error": 7}),
    ]
    for header in hostile:
        peer.send_raw(side.agent.transport.address,  # type: ignore[attr-defined]
                      [header, peer.session.to_decode.seal([header])])  # fmt: skip
        side.agent.poll()
    assert side.agent.stats.counts["undecodable_messages"] == len(hostile)
    assert side.engine.failed == {}


def test_a_fault_while_landing_fails_that_transfer_only() -> None:
    side = decode_side()
    peer = HandPeer(side.hub, "prefill", SECRET)
    request = handshake(side, peer)
    side.engine.raise_on_land = True
    send_pages(side, peer, request)
    assert side.agent.stats.counts["peer_faults"] == 1
    assert "could not be handled" in side.engine.failed["r1"]
    assert [type(r).__name__ for r in peer.receive()] == ["AbortTransfer"]
    side.engine.raise_on_land = False
    send_pages(side, peer, handshake_again(side, peer, "r2"))
    assert "r2" in side.engine.landed


def test_a_prefill_error_reaches_the_client_as_one_printable_bounded_line() -> None:
    side = decode_side()
    peer = HandPeer(side.hub, "prefill", SECRET)
    request = handshake(side, peer)
    assert peer.session is not None
    peer.send(side.agent.transport.address,  # type: ignore[attr-defined]
              m.PrefillFailed(request.transfer_id, "boom\n\x1b[31m" + "x" * 4000),
              peer.session.to_decode)  # fmt: skip
    side.agent.poll()
    error = side.engine.failed["r1"]
    assert error.startswith("kv_transfer_failed: boom") and error.isprintable()
    assert len(error) <= 330


# ---- addresses and connections -------------------------------------------------------------------
def test_an_unusable_address_fails_the_request_not_the_engine() -> None:
    side = decode_side()
    side.start("r1", "x")
    assert side.engine.failed["r1"].startswith("kv_peer_unreachable")
    assert side.agent.stats.counts["peer_unreachable"] == 1


@pytest.mark.parametrize(
    "address", ["x", "tcp://", "tcp://nohost", "udp://1.2.3.4:5", "tcp://h:port"]
)
def test_zeromq_refuses_bad_addresses_with_a_transport_error(address: str) -> None:
    context = zmq.Context()
    transport = ZmqTransport(context)
    try:
        with pytest.raises(TransportError):
            transport.connect(address)
        assert transport.waitables() == []  # no socket left open
    finally:
        transport.close()
        context.term()


def test_connections_are_bounded_idle_ones_are_closed_to_make_room() -> None:
    side = decode_side()
    for idx in range(MAX_PEERS):
        side.start(f"r{idx}", f"inproc-kv://silent-{idx}")  # peers that never answer
    side.start("one-too-many", "inproc-kv://silent-extra")
    assert side.engine.failed["one-too-many"].startswith("kv_peer_unreachable")
    side.clock.now += 6  # every handshake times out: those peers are idle now
    side.agent.poll()
    side.start("later", "inproc-kv://silent-later")
    assert "later" not in side.engine.failed
    assert len(side.agent.peers) == MAX_PEERS


def test_zeromq_sockets_are_bounded_and_closed_on_eviction() -> None:
    context = zmq.Context()
    transport = ZmqTransport(context, max_message_bytes=1 << 20)
    try:
        for port in range(1, 5):
            transport.connect(f"tcp://127.0.0.1:{port}")
        (first, *_) = transport.waitables()
        assert first.getsockopt(zmq.MAXMSGSIZE) == 1 << 20
        assert first.getsockopt(zmq.SNDHWM) > 0 and first.getsockopt(zmq.RCVHWM) > 0
        transport.disconnect("tcp://127.0.0.1:1")
        assert first.closed and len(transport.waitables()) == 3
    finally:
        transport.close()
        context.term()


# ---- the prefill side: who may run a prompt -------------------------------------------------------
def prefill_request(transfer_id: str = "t1", **changes: object) -> m.PrefillRequest:
    fields = dict(transfer_id=transfer_id, prompt_token_ids=PROMPT,
                  params=m.SamplingParams(max_tokens=4), cache_scope="tenant-a", first_block=0,
                  dest_page_ids=DEST_PAGE_IDS, dest_tags=DEST_TAGS)  # fmt: skip
    fields.update(changes)
    return m.PrefillRequest(**fields)  # type: ignore[arg-type]


def test_without_a_handshake_no_prompt_runs_under_any_scope() -> None:
    side = prefill_side()
    outsider = HandPeer(side.hub, "decode", ATTACKER_SECRET)
    outsider.send(side.address, prefill_request(cache_scope="tenant-b"), None)
    side.agent.poll()
    assert side.engine.started == {}
    # It is told "no session" (all a restarted prefill can say), and learns nothing else.
    (reply,) = outsider.receive()
    assert isinstance(reply, m.PrefillFailed) and reply.error.startswith("kv_peer_unknown")
    assert "num_cached" not in reply.error


def test_a_hello_without_the_secret_gets_no_answer() -> None:
    side = prefill_side()
    outsider = HandPeer(side.hub, "decode", ATTACKER_SECRET)
    outsider.hello(side.address)
    side.agent.poll()
    assert outsider.receive() == [] and side.agent._sessions == {}
    assert side.agent.stats.counts["unauthenticated_messages"] == 1


def shaken(side: object) -> HandPeer:
    peer = HandPeer(side.hub, "decode", SECRET)  # type: ignore[attr-defined]
    peer.hello(side.address)  # type: ignore[attr-defined]
    side.agent.poll()  # type: ignore[attr-defined]
    ((_, welcome),) = peer.transport.receive()
    peer.on_welcome(welcome)
    return peer


def test_a_member_runs_a_prompt_and_a_resend_flood_is_bounded() -> None:
    side = prefill_side()
    peer = shaken(side)
    peer.send(side.address, prefill_request(), peer.session.to_prefill)  # type: ignore[union-attr]
    side.agent.poll()
    assert list(side.engine.started) == ["pd-t1"]
    side.agent.take_outputs([RequestDelta("pd-t1", [5], finished=True, finish_reason="length")])
    for _ in range(20):  # 20 resends for 1 transfer (the attack re-sent 59 MB from 1.3 kB)
        peer.send(side.address, m.KVResend("t1"), peer.session.to_prefill)  # type: ignore[union-attr]
    side.agent.poll()
    kinds = [type(message).__name__ for message in peer.receive()]
    assert kinds == ["KVPages"] * (1 + MAX_RESENDS)
    assert side.agent.stats.counts["resends_refused"] == 20 - MAX_RESENDS


def test_acks_and_aborts_count_only_from_the_peer_that_asked() -> None:
    side = prefill_side()
    asker, other = shaken(side), shaken(side)
    asker.send(side.address, prefill_request(), asker.session.to_prefill)  # type: ignore[union-attr]
    side.agent.poll()
    other.send(side.address, m.AbortTransfer("t1"), other.session.to_prefill)  # type: ignore[union-attr]
    side.agent.poll()
    assert side.engine.aborted == [] and side.agent.transfers["t1"].state.value == "computing"


@pytest.mark.parametrize(
    "changes",
    [{"first_block": -1}, {"first_block": 5}, {"dest_page_ids": [1]}, {"dest_tags": [1, 2, 3]}],
)
def test_a_request_whose_pages_do_not_fit_its_prompt_is_refused(changes: dict[str, object]) -> None:
    side = prefill_side()
    peer = shaken(side)
    peer.send(side.address, prefill_request(**changes), peer.session.to_prefill)  # type: ignore[union-attr]
    side.agent.poll()
    assert side.engine.started == {}
    (reply,) = peer.receive()
    assert isinstance(reply, m.PrefillFailed)


def test_an_engine_fault_fails_that_prefill_only() -> None:
    side = prefill_side()
    peer = shaken(side)
    side.engine.raise_on_start = True
    peer.send(side.address, prefill_request("t1"), peer.session.to_prefill)  # type: ignore[union-attr]
    side.agent.poll()
    assert side.agent.stats.counts["peer_faults"] == 1
    (reply,) = peer.receive()
    assert isinstance(reply, m.PrefillFailed) and reply.transfer_id == "t1"
    side.engine.raise_on_start = False
    peer.send(side.address, prefill_request("t2"), peer.session.to_prefill)  # type: ignore[union-attr]
    side.agent.poll()
    assert "pd-t2" in side.engine.started


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_without_the_secret_there_is_no_kv_link_at_all(role: str) -> None:
    """Fail closed: no key anyone could compute, no port bound (not even on loopback, where
    any local process could otherwise run prompts under a scope it names)."""
    hub = InProcessHub()
    transport = InProcessTransport(hub)
    listened: list[str | None] = []
    transport.listen = lambda address=None: listened.append(address) or "x"  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=f"--role {role} needs the cluster secret"):
        KVAgents(cast(Any, None), role, transport, 1.0, "tcp://127.0.0.1:0", secret=None)
    assert listened == []
