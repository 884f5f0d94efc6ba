"""Exact page ids, tags and eviction order of the page pool."""

from __future__ import annotations

import pytest

from densa.cache.page_pool import PagePool, PagePoolError


def test_allocate_takes_lowest_free_pages_first_and_bumps_tags() -> None:
    pool = PagePool(4)
    assert pool.tags([0, 1, 2, 3]) == [0, 1, 2, 3]  # generation 0: tag == page id
    assert pool.allocate(2) == [0, 1]
    assert pool.tags([0, 1, 2, 3]) == [4, 5, 2, 3]  # generation 1: 1 * num_pages + page id
    assert pool.drain_tag_updates() == [(0, 4), (1, 5)]
    assert pool.drain_tag_updates() == []
    assert pool.num_free_pages == 2
    assert pool.ref_count(0) == 1


def test_a_pool_nobody_mirrors_keeps_no_tag_updates() -> None:
    """A proposer's own pool (spec/paged_rows.py) has no device-side tag table to mirror into,
    so nothing drains its updates: it must not queue them, or it grows by one entry per page
    allocated or freed for the server's whole life. Its tags change exactly as ever."""
    pool = PagePool(4, mirrored=False)
    for _ in range(2):
        assert pool.allocate(4) == [0, 1, 2, 3]
        pool.free([0, 1, 2, 3])
    assert pool.tags([0, 1, 2, 3]) == [16, 17, 18, 19]  # 4 changes each: generation 4
    assert pool.drain_tag_updates() == []


def test_allocate_too_many_returns_none_and_changes_nothing() -> None:
    pool = PagePool(3)
    pool.allocate(2)
    assert pool.allocate(2) is None
    assert pool.num_free_pages == 1
    assert pool.tags([0, 1, 2]) == [3, 4, 2]


def test_freed_pages_are_reused_oldest_first_with_a_new_tag() -> None:
    pool = PagePool(4)
    a = pool.allocate(2)  # [0, 1]
    b = pool.allocate(2)  # [2, 3]
    assert a is not None and b is not None
    pool.free(b)  # free queue: 2, 3
    pool.free(reversed(a))  # free queue: 2, 3, 1, 0
    assert pool.tags([0, 1, 2, 3]) == [8, 9, 10, 11]  # released: a stale holder mismatches now
    assert pool.allocate(4) == [2, 3, 1, 0]
    assert pool.tags([0, 1, 2, 3]) == [12, 13, 14, 15]
    assert all(pool.page_of_tag(pool.tag(p)) == p for p in range(4))


def test_touch_revives_a_free_page_without_changing_its_tag() -> None:
    pool = PagePool(3)
    pool.allocate(1)
    pool.free([0])
    assert pool.is_free(0)
    assert pool.tag(0) == 6  # allocated (3), released (6)
    pool.touch(0)
    assert not pool.is_free(0)
    assert pool.ref_count(0) == 1
    assert pool.tag(0) == 6
    pool.touch(0)  # shared by a second request
    pool.free([0])
    assert pool.ref_count(0) == 1 and not pool.is_free(0)


def test_double_free_is_an_error_and_changes_nothing() -> None:
    pool = PagePool(2)
    pool.allocate(2)
    pool.free([0])
    with pytest.raises(PagePoolError, match="double free of KV page 0"):
        pool.free([1, 0])
    assert pool.ref_count(1) == 1  # checked before anything was released
    with pytest.raises(PagePoolError, match="double free of KV page 1"):
        pool.free([1, 1])


def test_evict_callback_fires_on_reallocation_of_a_free_page() -> None:
    pool = PagePool(2)
    evicted: list[int] = []
    pool.set_evict_callback(evicted.append)
    pool.allocate(2)
    pool.free([1, 0])
    pool.allocate(1)
    assert evicted == [0, 1, 1]  # first allocation reports both fresh pages, then page 1 again


def test_consistency_check_catches_a_leak_and_an_unowned_reference() -> None:
    pool = PagePool(3)
    pages = pool.allocate(2)
    assert pages == [0, 1]
    pool.check_consistency({"a": [0, 1]})
    with pytest.raises(PagePoolError, match="page 1"):
        pool.check_consistency({"a": [0]})  # page 1 leaked
    with pytest.raises(PagePoolError, match="page 2"):
        pool.check_consistency({"a": [0, 1, 2]})  # page 2 mapped but free
