"""Authentication of the KV link: every message between two workers' KV agents carries an
HMAC-SHA256 over all of its frames, as one extra last frame.

Why HMAC per message rather than ZeroMQ CURVE: the link must prove membership (the cluster
secret) and integrity, not secrecy (page bytes are as confidential as the prompts the router
already sees in clear over HTTP; encrypt the network for that). A MAC over the frames replaces the
CRC32 the frames carried before, so damage and forgery are caught by one pass over the bytes
(SHA-256 with the CPU's SHA extensions runs at ~1.5-2 GB/s per core), it needs no key pairs or
ZAP handler, and it works the same over any KVTransport (in-process, ZeroMQ, an RDMA library's
control messages). CURVE would encrypt every page too, and bind keys per socket, not per peer.

The handshake derives a fresh session key, so a message recorded in one session is worthless in
another, and the two directions use different labels, so a message cannot be reflected back:

    D -> P  PeerHello(nonce_d)       MAC under hello_key            = K("hello")
    P -> D  PeerWelcome(nonce_p)     MAC under welcome_key(nonce_d) = K("welcome" | nonce_d)
    both    session_key = K("session" | nonce_d | nonce_p); then every message:
            MAC(session_key, direction | len(frame) | frame | len(frame) | frame ...)
    P -> D  PrefillFailed(kv_peer_unknown) from a P that has no session with D (it restarted):
            MAC under K("unknown-peer"); D then shakes hands again

Replays inside one session are not refused by the MAC (the transport may duplicate and reorder
on purpose); the state machines drop duplicates by transfer id, as they always did.

where K(x) = HMAC(link key, x) and the link key is ClusterSecret.key("kv-link"). Without a
secret, the link key is a public constant: the MACs still detect damage but authenticate nothing,
which is why a KV port without a secret may bind only to loopback (engine/disagg_port.py).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence

from densa.auth.secret import ClusterSecret

MAC_BYTES = 32
NONCE_BYTES = 16
D_TO_P = b"d->p"
P_TO_D = b"p->d"
# Public, so it authenticates nothing: only for a KV link bound to loopback, without a secret.
_NO_SECRET_KEY = hashlib.sha256(b"densa/v1/kv-link/no-secret").digest()

Frame = bytes | memoryview


def link_key(secret: ClusterSecret | None) -> bytes:
    return _NO_SECRET_KEY if secret is None else secret.key("kv-link")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


class FrameKey:
    """One MAC key and the direction it signs; `seal` and `verify` over a message's frames."""

    def __init__(self, key: bytes, direction: bytes) -> None:
        self._key = key
        self._direction = direction

    def seal(self, frames: Sequence[Frame]) -> bytes:
        mac = hmac.new(self._key, self._direction, hashlib.sha256)
        for frame in frames:
            mac.update(_nbytes(frame).to_bytes(8, "little"))
            mac.update(frame)
        return mac.digest()

    def verify(self, frames: Sequence[Frame]) -> bool:
        """The frames, last one the MAC: authentic and intact?"""
        if len(frames) < 2 or _nbytes(frames[-1]) != MAC_BYTES:
            return False
        return hmac.compare_digest(self.seal(frames[:-1]), bytes(frames[-1]))


class LinkKeys:
    """The keys of one worker's KV link, derived from the cluster secret (or none)."""

    def __init__(self, secret: ClusterSecret | None) -> None:
        self._key = link_key(secret)
        self.authenticated = secret is not None

    def _derive(self, *parts: bytes) -> bytes:
        return hmac.new(self._key, b"|".join(parts), hashlib.sha256).digest()

    def hello(self) -> FrameKey:
        return FrameKey(self._derive(b"hello"), D_TO_P)

    def welcome(self, nonce_d: bytes) -> FrameKey:
        return FrameKey(self._derive(b"welcome", nonce_d), P_TO_D)

    def unknown_peer(self) -> FrameKey:
        """P's one message outside a session: "I have no session with you" (it restarted), so
        D shakes hands again. Any member can make it; it changes nothing but that."""
        return FrameKey(self._derive(b"unknown-peer"), P_TO_D)

    def session(self, nonce_d: bytes, nonce_p: bytes) -> Session:
        return Session(self._derive(b"session", nonce_d, nonce_p))


class Session:
    """A handshake's session: one key, a FrameKey per direction."""

    def __init__(self, key: bytes) -> None:
        self.to_prefill = FrameKey(key, D_TO_P)
        self.to_decode = FrameKey(key, P_TO_D)


def _nbytes(frame: Frame) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)
