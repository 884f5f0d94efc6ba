"""The prefix-cache scope: which requests may share cached KV pages.

Requests reuse each other's pages only within one scope, so a tenant can never learn from response
times whether another tenant sent a given prompt. The scope is a structured value, not a string a
client can spell: each part is length-prefixed before hashing, so no choice of `user` or
`cache_salt` text can reproduce another combination (`user="u|salt:s"` is not `user="u"` +
`cache_salt="s"`), and the tenant part is the identity of the authenticated key, never the text of
the Authorization header (`bearer K` and `Bearer K` are the same tenant).

Torch-free and dependency-free: the router computes the same digests to place requests.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

# Separates densa's scope digests from any other BLAKE2b use of the same bytes.
_PERSON = b"densa-scope-v1"


@dataclass(frozen=True)
class CacheScope:
    tenant: str | None = None  # identity of the API key (see tenant_of), None: anonymous
    user: str | None = None  # the request's `user`: separates a tenant's end users
    salt: str | None = None  # the request's `cache_salt`: opts out of sharing with anyone else

    def digest(self) -> str:
        """A fixed-length hex digest of the canonical encoding (what block hashes are keyed by).

        Every field is written as a presence byte, then its UTF-8 length (8 bytes) and bytes.
        The text fields must be encodable (the HTTP layer rejects lone surrogates before this).
        """
        digest = hashlib.blake2b(digest_size=16, person=_PERSON)
        for part in (self.tenant, self.user, self.salt):
            if part is None:
                digest.update(b"\x00")
                continue
            data = part.encode("utf-8")
            digest.update(b"\x01" + len(data).to_bytes(8, "big") + data)
        return digest.hexdigest()


ANONYMOUS = CacheScope()


def tenant_of(api_key: str) -> str:
    """The tenant identity of an API key: a digest of the key itself (keys are secrets: neither
    logs nor memory dumps should hold them)."""
    return hashlib.blake2b(
        api_key.encode("utf-8"), digest_size=16, person=b"densa-tenant"
    ).hexdigest()
