"""A hypothesis fuzz of the KV protocol: whatever frames reach an agent -- garbage, or messages of
every type with arbitrary fields, sealed by a peer holding the secret -- no exception escapes
`poll`, and nothing lands or runs that the checks would refuse."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from densa.disagg import messages as m
from tests.disagg.peers import (
    DEST_PAGE_IDS,
    DEST_TAGS,
    PROMPT,
    SECRET,
    VOCAB,
    HandPeer,
    decode_side,
    page_frames,
    prefill_side,
)
from tests.disagg.test_peer_trust import handshake, shaken

MESSAGE_TYPES = ["PeerHello", "PeerWelcome", "PrefillRequest", "KVPages", "PrefillFailed",
                 "KVAck", "KVResend", "AbortTransfer", "AbortAck", "Unknown"]  # fmt: skip
FIELDS = ["transfer_id", "prompt_token_ids", "params", "cache_scope", "first_block",
          "dest_page_ids", "dest_tags", "layout", "first_token_id", "first_logprobs",
          "num_cached_tokens", "prefill_ms", "error", "model", "nonce"]  # fmt: skip

# Integers at the edges that matter: ids just outside the vocabulary, negative, 64-bit and wider.
edge_ints = st.sampled_from([-1, 0, 1, 19, 20, 21, VOCAB - 1, VOCAB, 2**31, 2**63 - 1, -(2**63)])
scalars = st.one_of(st.none(), st.booleans(), edge_ints, st.integers(-(2**63), 2**64 - 1), st.floats(),
                    st.text(max_size=20), st.binary(max_size=20))  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@st.composite
def tagged(draw: st.DrawFn) -> dict[str, Any]:
    """A message-shaped dict: a real (or unknown) type tag, some real field names."""
    message: dict[str, Any] = {"type": draw(st.sampled_from(MESSAGE_TYPES))}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True)):
        message[name] = draw(values)
    if draw(st.booleans()):  # aim at the live transfer some of the time
        message["transfer_id"] = draw(st.sampled_from(["r1#0", "t1"]))
    return message


@st.composite
def pages_messages(draw: st.DrawFn) -> m.KVPages:
    """Well-typed KVPages with fields drawn around the valid values."""
    layout, _ = page_frames()
    return m.KVPages(
        transfer_id=draw(st.sampled_from(["r1#0", "r1#1", "zz"])),
        dest_page_ids=draw(st.sampled_from([DEST_PAGE_IDS, [7], [7, 8], []])),
        dest_tags=draw(st.sampled_from([DEST_TAGS, [3], [3, 6]])),
        layout=layout,
        first_token_id=draw(edge_ints),
        first_logprobs=None,
        num_cached_tokens=draw(edge_ints),
        prefill_ms=1.0,
    )


fuzz = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@fuzz
@given(frames=st.lists(st.binary(max_size=64), max_size=5), sealed=st.booleans())
def test_garbage_frames_never_raise(frames: list[bytes], sealed: bool) -> None:
    d = decode_side()
    peer = HandPeer(d.hub, "prefill", SECRET)
    handshake(d, peer)
    assert peer.session is not None
    tail = [peer.session.to_decode.seal(frames)] if sealed else []
    peer.send_raw(d.agent.transport.address, [*frames, *tail])  # type: ignore[attr-defined]
    d.agent.poll()
    assert d.engine.landed == {}

    p = prefill_side()
    member = shaken(p)
    assert member.session is not None
    tail = [member.session.to_prefill.seal(frames)] if sealed else []
    member.send_raw(p.address, [*frames, *tail])
    p.agent.poll()
    assert p.engine.started == {}


@fuzz
@given(message=tagged())
def test_sealed_messages_of_any_shape_never_raise(message: dict[str, Any]) -> None:
    header = msgspec.msgpack.encode(message)
    d = decode_side()
    peer = HandPeer(d.hub, "prefill", SECRET)
    handshake(d, peer)
    assert peer.session is not None
    peer.send_raw(d.agent.transport.address,  # type: ignore[attr-defined]
                  [header, peer.session.to_decode.seal([header])])  # fmt: skip
    d.agent.poll()
    assert d.engine.landed == {}  # a header alone never carries the pages

    p = prefill_side()
    member = shaken(p)
    assert member.session is not None
    member.send_raw(p.address, [header, member.session.to_prefill.seal([header])])
    p.agent.poll()
    for request in p.engine.started.values():  # whatever ran, ran a request that fits
        assert request.first_block >= 0 and len(request.dest_page_ids) == len(request.dest_tags)


@fuzz
@given(pages=pages_messages())
def test_pages_land_only_when_every_field_fits(pages: m.KVPages) -> None:
    d = decode_side()
    peer = HandPeer(d.hub, "prefill", SECRET)
    handshake(d, peer)
    assert peer.session is not None
    _, frames = page_frames()
    out = [m.encode(pages), *frames]
    peer.send_raw(d.agent.transport.address, [*out, peer.session.to_decode.seal(out)])  # type: ignore[attr-defined]
    d.agent.poll()
    fits = (
        pages.transfer_id == "r1#0"
        and pages.dest_page_ids == DEST_PAGE_IDS
        and pages.dest_tags == DEST_TAGS
        and 0 <= pages.first_token_id < VOCAB
        and 0 <= pages.num_cached_tokens <= len(PROMPT)
    )
    assert ("r1" in d.engine.landed) == fits
