"""The router's placement token: the only way a client request reaches a prefill worker.

A decode worker acts on `x-densa-prefill: URL` only when the request also carries
`x-densa-placement: TOKEN`, a token the router signed for that URL (or when the URL is on the
worker's own allowlist, `--prefill-peer`). Any HTTP client can send headers; only a holder of the
cluster secret can make a token, so no client can choose where a worker connects.

    TOKEN = "v1." placement_id "." expiry "." hex(HMAC-SHA256(placement key, signed text))
    signed text = "v1|" placement_id "|" expiry "|" prefill URL

placement_id is random per routed request (a replayed token is refused by the worker within its
lifetime, see PlacementVerifier); expiry is in Unix seconds, so router and workers need clocks
that agree to within the token's lifetime (30 s by default).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

from densa.auth.secret import ClusterSecret

PLACEMENT_HEADER = "x-densa-placement"
DEFAULT_TTL_S = 30.0
_VERSION = "v1"
_MAX_TOKEN_LEN = 256
_MAX_REMEMBERED = 65536  # placement ids kept to refuse replays (each lives a token's lifetime)


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
    """Checks tokens on a worker; remembers the ids it accepted until they expire (replays)."""

    def __init__(self, secret: ClusterSecret, clock: Callable[[], float] = time.time) -> None:
        self._key = secret.key("placement")
        self._clock = clock
        self._seen: OrderedDict[str, int] = OrderedDict()  # placement id -> expiry, oldest first

    def verify(self, token: str, prefill_url: str) -> None:
        """Raise PlacementError unless `token` authorizes `prefill_url` now, for the first time."""
        placement_id, expiry = self._parse(token)
        mac = token.rsplit(".", 1)[1]
        if not hmac.compare_digest(mac, _mac(self._key, placement_id, expiry, prefill_url)):
            raise PlacementError("bad_signature")
        now = self._clock()
        if expiry < now:
            raise PlacementError("expired")
        self._forget_expired(now)
        if placement_id in self._seen:
            raise PlacementError("replayed")
        if len(self._seen) >= _MAX_REMEMBERED:
            self._seen.popitem(last=False)
        self._seen[placement_id] = expiry

    @staticmethod
    def _parse(token: str) -> tuple[str, int]:
        parts = token.split(".")
        if len(token) > _MAX_TOKEN_LEN or len(parts) != 4 or parts[0] != _VERSION:
            raise PlacementError("malformed")
        _, placement_id, expiry, mac = parts
        if not (placement_id.isalnum() and expiry.isdigit() and len(mac) == 64):
            raise PlacementError("malformed")
        return placement_id, int(expiry)

    def _forget_expired(self, now: float) -> None:
        # Tokens are issued with one lifetime, so expiries arrive nearly in order: the oldest
        # first entries are the ones that can go.
        while self._seen:
            placement_id, expiry = next(iter(self._seen.items()))
            if expiry >= now:
                return
            del self._seen[placement_id]
