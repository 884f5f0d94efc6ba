"""The prefix-cache scope is a structured value: no spelling of its parts can collide."""

from __future__ import annotations

import itertools

from densa.cache.scope import ANONYMOUS, CacheScope, tenant_of


def test_parts_are_length_prefixed_so_separators_cannot_collide() -> None:
    scopes = [
        CacheScope(user="u|salt:s"),
        CacheScope(user="u", salt="s"),
        CacheScope(user="u|salt:", salt="s"),
        CacheScope(user="u", salt="|salt:s"),
        CacheScope(tenant="t", user="u"),
        CacheScope(tenant="tu"),
        CacheScope(user="tu"),
        CacheScope(user=""),  # an empty user is not an absent one
        CacheScope(salt=""),
        CacheScope(user="\x00", salt=None),
        CacheScope(user=None, salt="\x00"),
        ANONYMOUS,
    ]
    digests = [s.digest() for s in scopes]
    assert len(set(digests)) == len(scopes)
    for a, b in itertools.combinations(scopes, 2):
        assert (a == b) == (a.digest() == b.digest())


def test_the_digest_is_stable_and_fixed_length() -> None:
    scope = CacheScope(tenant=tenant_of("key-a"), user="alice", salt="s1")
    assert scope.digest() == CacheScope(tenant=tenant_of("key-a"), user="alice", salt="s1").digest()
    assert len(scope.digest()) == 32 and scope.digest().isascii()
    assert len(CacheScope(user="x" * 100_000).digest()) == 32


def test_tenants_are_keys_not_header_text() -> None:
    assert tenant_of("key-a") == tenant_of("key-a")
    assert tenant_of("key-a") != tenant_of("key-b")
    assert "key-a" not in tenant_of("key-a")  # the secret itself is never kept
