"""The cluster secret: what makes a process a member of the internal plane.

Every member (router, workers, the cluster supervisor) is given the same secret, as a file
(`--cluster-secret-file`, mode 0600) or the environment variable DENSA_CLUSTER_SECRET; never on
the command line, where `ps` would show it. Nothing uses the secret itself: each purpose gets its
own key, HMAC-SHA256(secret, "densa/v1/" + purpose), so a key leaked from one use (say a
placement token's) tells nothing about another's (the KV link's).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from densa.utils.private_files import create_private_file

SECRET_ENV = "DENSA_CLUSTER_SECRET"
MIN_SECRET_BYTES = 16  # shorter secrets are refused: they could be guessed offline
_KEY_LABEL = b"densa/v1/"


class SecretError(ValueError):
    """The cluster secret is missing, unreadable or too short (the message says which)."""


@dataclass(frozen=True)
class ClusterSecret:
    value: bytes = field(repr=False)  # never printed, never logged

    def __post_init__(self) -> None:
        if len(self.value) < MIN_SECRET_BYTES:
            raise SecretError(
                f"the cluster secret has {len(self.value)} bytes; it needs at least "
                f"{MIN_SECRET_BYTES} (make one with `umask 077; openssl rand -hex 32 > FILE`)"
            )

    def key(self, purpose: str) -> bytes:
        """The 32-byte key for one purpose ("placement", "kv-link", ...)."""
        return hmac.new(self.value, _KEY_LABEL + purpose.encode(), hashlib.sha256).digest()

    @classmethod
    def generate(cls) -> ClusterSecret:
        return cls(secrets.token_hex(32).encode())

    @classmethod
    def from_file(cls, path: str | Path) -> ClusterSecret:
        try:
            text = Path(path).read_text().strip()
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise SecretError(f"cannot read the cluster secret file {path}: {reason}") from exc
        return cls(text.encode())

    def write(self, path: str | Path) -> None:
        """Write the secret to a new file only its owner can read (mode 0600). Never into an
        existing file, never through a symlink: a file or link someone planted at `path` is a
        SecretError, not a copy of the secret for them. Put it in a private_dir."""
        try:
            create_private_file(path, self.value + b"\n")
        except FileExistsError as exc:
            raise SecretError(f"{path} exists already: the cluster secret is written only to "
                              "a new file (remove the old one first)") from exc  # fmt: skip
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise SecretError(f"cannot write the cluster secret file {path}: {reason}") from exc


def load_secret(path: str | None = None) -> ClusterSecret | None:
    """The secret from `path` if given, else from DENSA_CLUSTER_SECRET, else None (no internal
    plane: no KV link, so --role prefill and --role decode refuse to start)."""
    if path:
        return ClusterSecret.from_file(path)
    value = os.environ.get(SECRET_ENV, "").strip()
    return ClusterSecret(value.encode()) if value else None
