"""The router's placement token: the only way a client request reaches a prefill worker.

A decode worker acts on `x-densa-prefill: URL` only when the request also carries
`x-densa-placement: TOKEN`, a token the router signed for that URL (or when the URL is on the
worker's own allowlist, `--prefill-peer`). Any HTTP client can send headers; only a holder of the
cluster secret can make a token, so no client can choose where a worker connects.

    TOKEN = "v1." placement_id "." expiry "." hex(HMAC-SHA256(placement key, signed text))
    signed text = "v1|" placement_id "|" expiry "|" prefill URL

placement_id is random per routed request, so tokens never repeat; expiry is in Unix seconds, so
router and workers need clocks that agree to within the token's lifetime (30 s by default).
A token is not single-use on purpose: a client's or the router's retry of the same request
resends it, and reusing it within its lifetime can only repeat what the router allowed (reach
that prefill worker), never choose another. It binds the URL, so it cannot be moved to another.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable

from densa.auth.secret import ClusterSecret

PLACEMENT_HEADER = "x-densa-placement"
DEFAULT_TTL_S = 30.0
_VERSION = "v1"
_MAX_TOKEN_LEN = 256


class PlacementError(ValueError):
    """A token that does not authorize this placement. `reason` is a fixed word (safe for
    metrics and logs); the token's own text is never repeated back."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid placement token: {reason}")
        self.reason = reason


def _mac(key: bytes, placement_id: str, expiry: int, prefill_url: str) -> str:
    text = f"{_VERSION}|{placement_id}|{expiry}|{prefill_url}".encode()
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def sign_placement(
    secret: ClusterSecret,
    prefill_url: str,
    ttl_s: float = DEFAULT_TTL_S,
    clock: Callable[[], float] = time.time,
) -> str:
    """A token letting one request's decode worker reach `prefill_url` for `ttl_s` seconds."""
    placement_id = secrets.token_hex(12)
    expiry = int(clock() + ttl_s)
    mac = _mac(secret.key("placement"), placement_id, expiry, prefill_url)
    return f"{_VERSION}.{placement_id}.{expiry}.{mac}"


class PlacementVerifier:
    """Checks tokens on a worker."""

    def __init__(self, secret: ClusterSecret, clock: Callable[[], float] = time.time) -> None:
        self._key = secret.key("placement")
        self._clock = clock

    def verify(self, token: str, prefill_url: str) -> None:
        """Raise PlacementError unless `token` authorizes `prefill_url` now. Any text at all
        is either a token or a PlacementError: nothing a client sends raises anything else."""
        placement_id, expiry, mac = _parse(token)
        expected = _mac(self._key, placement_id, expiry, prefill_url)
        if not hmac.compare_digest(mac.encode(), expected.encode()):  # both ASCII (_TOKEN)
            raise PlacementError("bad_signature")
        if expiry < self._clock():
            raise PlacementError("expired")


# Exactly what sign_placement writes, in ASCII only: str.isdigit() and isalnum() also accept
# "²" or "é", which int() and compare_digest then refused with a 500.
_TOKEN = re.compile(
    rf"{_VERSION}\.([0-9A-Za-z]{{1,64}})\.([0-9]{{1,12}})\.([0-9a-f]{{64}})", re.ASCII
)


def _parse(token: str) -> tuple[str, int, str]:
    """(placement_id, expiry, mac) of a well-formed token; PlacementError("malformed") else."""
    match = _TOKEN.fullmatch(token) if len(token) <= _MAX_TOKEN_LEN else None
    if match is None:
        raise PlacementError("malformed")
    placement_id, expiry, mac = match.groups()
    return placement_id, int(expiry), mac
