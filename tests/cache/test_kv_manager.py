"""KV manager: slot allocation, prefix reuse within a scope, LRU eviction, exact page ids."""

from __future__ import annotations

from densa.cache.integrity import ViolationKind
from densa.cache.kv_manager import KVCacheManager
from densa.request import Request
from densa.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int], scope: str = "") -> Request:
    return Request(request_id, list(tokens), SamplingParams(), cache_scope=scope)


def admit(kv: KVCacheManager, request: Request) -> list[int] | None:
    """What the scheduler does for a new request: prefix hit, then pages for the rest."""
    hit = kv.find_prefix(request)
    num_hit = hit.num_tokens(kv.page_size)
    new_pages = kv.allocate_slots(request, request.num_tokens - num_hit, hit)
    if new_pages is not None:
        request.num_computed_tokens = request.num_tokens
        kv.cache_full_pages(request)
    return new_pages


def test_allocation_covers_exactly_the_tokens() -> None:
    kv = KVCacheManager(num_pages=8, page_size=4, enable_prefix_caching=False)
    req = make_request("a", list(range(10)))
    assert kv.allocate_slots(req, 10) == [0, 1, 2]
    assert req.page_ids == [0, 1, 2] and req.page_tags == [8, 9, 10]
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 2) == []  # 12 tokens still fit in 3 pages
    req.num_computed_tokens = 12
    assert kv.allocate_slots(req, 1) == [3]
    kv.free(req)
    assert req.page_ids == [] and kv.num_free_pages == 8


def test_no_room_returns_none_and_leaves_the_request_untouched() -> None:
    kv = KVCacheManager(num_pages=2, page_size=4)
    req = make_request("a", list(range(12)))
    assert kv.allocate_slots(req, 12) is None
    assert req.page_ids == [] and kv.num_free_pages == 2


def test_identical_prefix_reuses_full_pages_and_leaves_the_last_token_to_compute() -> None:
    kv = KVCacheManager(num_pages=8, page_size=4)
    first = make_request("a", list(range(10)))
    assert admit(kv, first) == [0, 1, 2]
    second = make_request("b", [*range(8), 99, 98])
    hit = kv.find_prefix(second)
    assert hit.page_ids == (0, 1)  # two full pages shared, the partial page is not
    assert admit(kv, second) == [3]
    assert second.page_ids == [0, 1, 3]
    assert kv.pool.ref_count(0) == 2
    # A prompt of exactly 8 cached tokens still computes its last token: only 1 page is reused.
    third = make_request("c", list(range(8)))
    assert kv.find_prefix(third).page_ids == (0,)


def test_prefix_pages_survive_their_owner_and_are_evicted_lru() -> None:
    kv = KVCacheManager(num_pages=4, page_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(kv, a)  # pages 0, 1 full (cached), 2 partial
    kv.free(a)  # free queue: 3, 2, 1, 0 (tail pages first)
    b = make_request("b", [1, 2, 3, 4, 9])
    assert kv.find_prefix(b).page_ids == (0, 1)
    assert admit(kv, b) == [2]  # the partial page held nothing reusable: it goes first
    kv.free(b)
    # A new unrelated request needing all 4 pages evicts the cached ones; no hit remains.
    c = make_request("c", [7] * 8)
    assert admit(kv, c) is not None
    kv.free(c)
    assert kv.find_prefix(make_request("d", [1, 2, 3, 4, 5])).page_ids == ()


def test_prefix_reuse_is_scoped_per_tenant() -> None:
    kv = KVCacheManager(num_pages=8, page_size=4)
    admit(kv, make_request("a", list(range(9)), scope="tenant-1"))
    assert kv.find_prefix(make_request("b", list(range(9)), scope="tenant-2")).page_ids == ()
    assert kv.find_prefix(make_request("c", list(range(9)), scope="tenant-1")).page_ids == (0, 1)


def test_a_hit_on_free_cached_pages_counts_against_free_room() -> None:
    kv = KVCacheManager(num_pages=3, page_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    kv.free(a)
    b = make_request("b", [1, 2, 3, 4, 6, 7, 8])  # hit on 2 free pages + needs 2 more: 4 > 3
    hit = kv.find_prefix(b)
    assert hit.page_ids == (0, 1)
    assert kv.allocate_slots(b, 3, hit) is None
    assert b.page_ids == [] and kv.num_free_pages == 3


def test_only_the_exclusive_current_owner_may_write_a_page() -> None:
    kv = KVCacheManager(num_pages=8, page_size=4)
    a = make_request("a", list(range(9)))
    admit(kv, a)  # pages 0, 1 full and indexed, page 2 partial
    b = make_request("b", [*range(8), 50, 51])
    admit(kv, b)  # shares pages 0, 1 with a
    assert kv.check_writer("a", a, [2], [a.page_tags[2]]) is None  # a's own, unshared page
    shared = kv.check_writer("a", a, [0], [a.page_tags[0]])
    assert (
        shared is not None and shared.kind is ViolationKind.STALE_WRITE
    )  # prefix pages are immutable
    old_tags = list(a.page_tags)
    kv.free(a)
    # a is gone: even page 0, still held by b with an unchanged tag, refuses a's late write.
    assert kv.pool.tag(0) == old_tags[0]
    assert kv.check_writer("a", None, [0], [old_tags[0]]) is not None
    assert kv.check_writer("a", None, [2], [old_tags[2]]) is not None
    wrong = kv.check_writer("b", b, [b.page_ids[2]], [old_tags[2]])
    assert wrong is not None and wrong.kind is ViolationKind.BAD_MAPPING


def test_uncached_pages_are_reused_before_cached_ones() -> None:
    kv = KVCacheManager(num_pages=4, page_size=2)
    a = make_request("a", [1, 2, 3])  # page 0 full (cached), page 1 partial (nothing reusable)
    admit(kv, a)
    kv.free(a)
    assert kv.allocate_slots(make_request("b", [9]), 1) == [1]  # the partial page goes first
    assert kv.allocate_slots(make_request("c", [9]), 1) == [2]
    assert kv.find_prefix(make_request("d", [1, 2, 3])).page_ids == (0,)  # still cached


def test_session_pages_outlive_other_cached_pages() -> None:
    kv = KVCacheManager(num_pages=6, page_size=2)
    chat = make_request("chat", [1, 2, 3, 4])
    chat.session_id = "s1"
    admit(kv, chat)  # pages 0, 1, both cached
    kv.free(chat)  # protected: [1, 0]
    other = make_request("x", [20, 21, 22, 23])
    admit(kv, other)  # pages 2, 3
    kv.free(other)  # free queue: 4, 5, 3, 2 -- released later than the chat, yet evicted first
    newcomer = make_request("y", list(range(30, 38)))
    admit(kv, newcomer)
    assert newcomer.page_ids == [4, 5, 3, 2]
    assert kv.find_prefix(make_request("chat-turn-2", [1, 2, 3, 4, 9])).page_ids == (0, 1)
    assert kv.find_prefix(make_request("x-again", [20, 21, 22, 23, 9])).page_ids == ()
