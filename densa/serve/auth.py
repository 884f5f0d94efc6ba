"""Optional API keys (`--api-key`, `--api-key-file`): `Authorization: Bearer <key>` on /v1/*
(or `x-api-key: <key>`, as Anthropic's clients send it).

With no keys configured every request is let through (a loopback or private deployment). /health,
/metrics and /openapi.json stay open either way: load balancers and scrapers carry no key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

from fastapi.security import HTTPAuthorizationCredentials

from densa.openai.errors import unauthorized


class ApiKeys:
    """The keys a server accepts, compared in constant time."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        # Digests, so every comparison has the same length and takes the same time.
        self._digests = [_digest(key) for key in keys]

    @property
    def is_enabled(self) -> bool:
        return bool(self._digests)

    def check(self, credentials: HTTPAuthorizationCredentials | None) -> None:
        """Raise a 401 APIError unless the bearer key is one of ours (or no keys are set)."""
        if not self._digests:
            return
        if credentials is None:
            raise unauthorized(has_key=False)
        offered = _digest(credentials.credentials)
        # Compare with every key, no early exit: the time taken says nothing about which matched.
        matches = [hmac.compare_digest(offered, digest) for digest in self._digests]
        if not any(matches):
            raise unauthorized(has_key=True)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def load_api_keys(keys: Iterable[str] = (), key_file: str | Path | None = None) -> ApiKeys:
    """Keys from the command line plus those in key_file (one per line; blank lines and lines
    starting with '#' are skipped). Raises ValueError for an empty key or a file without keys."""
    all_keys = list(keys)
    if key_file is not None:
        lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        from_file = [line.strip() for line in lines]
        from_file = [key for key in from_file if key and not key.startswith("#")]
        if not from_file:
            raise ValueError(f"the API key file {key_file} holds no keys")
        all_keys += from_file
    if any(not key.strip() for key in all_keys):
        raise ValueError("an API key may not be empty")
    return ApiKeys(key.strip() for key in all_keys)
