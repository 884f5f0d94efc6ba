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

where K(x) = HMAC(link key, x) and the link key is ClusterSecret.key("kv-link"). There is no
link without a secret (`link_secret`): a key anyone could compute would authenticate nothing, and
whoever reached the port, even from this host, could run prompts under any cache scope and read
the pages and cached-token counts. An in-process pair (no port) shares a secret made for it.
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

Frame = bytes | memoryview


def link_secret(role: str, secret: ClusterSecret | None) -> ClusterSecret:
    """The secret a worker of `role` ("prefill" or "decode") authenticates its KV link with;
    ValueError without one: no secret, no KV port (fail closed, as the decode side refuses an
    unsigned placement)."""
    if secret is None:
        raise ValueError(
            f"--role {role} needs the cluster secret (--cluster-secret-file FILE or "
            "$DENSA_CLUSTER_SECRET): its KV link runs prompts and moves KV pages only between "
            "workers that prove the secret, and without one it could prove nothing. Make one "
            "with `umask 077; openssl rand -hex 32 > FILE` and give the same file to the "
            "router and every worker"
        )
    return secret


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
    """The keys of one worker's KV link, derived from the cluster secret."""

    def __init__(self, secret: ClusterSecret) -> None:
        self._key = secret.key("kv-link")

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
