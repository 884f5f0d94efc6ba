"""The stored form of one KV page in a tier, and its check on every read.

    offset  bytes  field
    0       4      magic b"DKVB"
    4       1      format version (2: always keyed)
    5       3      zero
    8       16     block key: the page's tenant-scoped hash chain (cache/prefix_index.py)
    24      16     fingerprint of the model and the KV format the bytes are in
    40      8      payload length, little-endian
    48      32     MAC: BLAKE2b-256 keyed with the tier's key, over bytes [0, 48) and the payload
    80      n      payload: the page in the engine's KV format (worker/kv_io.py's bytes)

Every tier is keyed: under the cluster's tier key where there is a cluster secret, else under a
key of the tier's own (the disk tier's directory key, the host tier's process key). An unkeyed
checksum would only catch damage: whoever can write a tier's storage could compute it for pages
of their choosing, and those pages would become attention input of the tenant whose key they
were stored under. The MAC covers the header too, so a block cannot be renamed (moved to another
block key: another block's or another tenant's value replayed under this key) or relabelled
(another model's pages) without failing. Torch-free: tiers move bytes only.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

MAGIC = b"DKVB"
# 2: every block is MAC'd (version 1 allowed an unkeyed checksum); version-1 blocks are misses.
VERSION = 2
KEY_BYTES = 16
FINGERPRINT_BYTES = 16
CHECKSUM_BYTES = 32
HEADER_BYTES = 48
BLOCK_OVERHEAD = HEADER_BYTES + CHECKSUM_BYTES
MAX_BLOCK_BYTES = 64 << 20  # a page of the largest model densa serves is a few MiB: read no more
MIN_MAC_KEY_BYTES = 16  # BLAKE2b takes keys of 1..64 bytes; a short one could be guessed
MAX_MAC_KEY_BYTES = 64
# Why a block can fail, one word each: the counters (/metrics) and log lines use these names.
REJECT_REASONS = ("truncated", "format", "key", "fingerprint", "checksum")


class BlockRejected(ValueError):
    """A stored block that failed a check: the reason is one word (for the counter) and detail."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in REJECT_REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class BlockCodec:
    """Encodes and checks blocks for one engine (its fingerprint) and one tier (its MAC key)."""

    fingerprint: bytes
    mac_key: bytes = field(repr=False)  # never printed: whoever holds it can forge blocks

    def __post_init__(self) -> None:
        if len(self.fingerprint) != FINGERPRINT_BYTES:
            raise ValueError(f"a fingerprint has {FINGERPRINT_BYTES} bytes")
        if not MIN_MAC_KEY_BYTES <= len(self.mac_key) <= MAX_MAC_KEY_BYTES:
            raise ValueError(
                f"a tier's MAC key has {MIN_MAC_KEY_BYTES} to {MAX_MAC_KEY_BYTES} bytes"
            )

    def encode(self, key: bytes, payload: bytes | memoryview) -> bytes:
        header = self._header(key, len(payload))
        return b"".join((header, self._mac(header, payload), payload))

    def decode(self, key: bytes, data: bytes | memoryview) -> memoryview:
        """The payload of a block stored under `key`; raises BlockRejected on any failed check."""
        view = memoryview(data)
        if len(view) < BLOCK_OVERHEAD:
            raise BlockRejected("truncated", f"{len(view)} bytes")
        header = bytes(view[:HEADER_BYTES])
        if header[:4] != MAGIC or header[4] != VERSION:
            raise BlockRejected("format", "not a densa KV block of this version")
        if header[8:24] != key:
            raise BlockRejected("key", "stored under another block key")
        if header[24:40] != self.fingerprint:
            raise BlockRejected("fingerprint", "another model or KV format")
        length = int.from_bytes(header[40:48], "little")
        payload = view[BLOCK_OVERHEAD:]
        if len(payload) != length:
            raise BlockRejected(
                "truncated", f"payload of {len(payload)} bytes, header says {length}"
            )
        stored = bytes(view[HEADER_BYTES:BLOCK_OVERHEAD])
        if not hmac.compare_digest(stored, self._mac(header, payload)):
            raise BlockRejected("checksum", "the bytes or their MAC do not match this tier's key")
        return payload

    def _header(self, key: bytes, length: int) -> bytes:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a block key has {KEY_BYTES} bytes")
        prefix = MAGIC + bytes([VERSION, 0, 0, 0])
        return prefix + key + self.fingerprint + length.to_bytes(8, "little")

    def _mac(self, header: bytes, payload: bytes | memoryview) -> bytes:
        digest = hashlib.blake2b(digest_size=CHECKSUM_BYTES, key=self.mac_key)
        digest.update(header)
        digest.update(payload)
        return digest.digest()


def fingerprint_of(*parts: str) -> bytes:
    """A fingerprint over text parts (model identity, KV format, page geometry), length-prefixed
    so no two lists of parts encode alike."""
    digest = hashlib.blake2b(digest_size=FINGERPRINT_BYTES, person=b"densa-kvtier")
    for part in parts:
        data = part.encode("utf-8")
        digest.update(len(data).to_bytes(8, "big") + data)
    return digest.digest()
