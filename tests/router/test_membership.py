"""PUT /densa/workers: the router's worker set replaced while it serves (densa cluster uses it)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from densa.ipc.messages import TokenizerFiles
from densa.openai.errors import APIError
from densa.router.membership import apply_membership, roles_from_body
from densa.router.routing import Router
from densa.text.tokenizer import read_tokenizer_files

from .test_proxy import CHAT, dead_url, fakes, router

TOKEN = "s3cret-admin"
ADMIN = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def tokenizer_files(tiny_model_dir: Path) -> TokenizerFiles:
    return read_tokenizer_files(tiny_model_dir)


def put(base: str, token: str | None = TOKEN, **pools: list[str]) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.put(base + "/densa/workers", json=pools, headers=headers, timeout=10)


def served_by(base: str, n: int) -> list[str]:
    return [
        httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=10).headers["x-densa-worker"]
        for _ in range(n)
    ]


def wait_healthy(base: str, urls: set[str], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = httpx.get(base + "/densa/workers", headers=ADMIN, timeout=5).json()["workers"]
        if {w["url"] for w in listed if w["healthy"]} == urls:
            return
        time.sleep(0.05)
    raise AssertionError(f"not healthy within {timeout} s: {urls}")


def test_a_joining_worker_takes_traffic_and_a_leaving_one_gets_none(
    tokenizer_files: TokenizerFiles,
) -> None:
    with (
        fakes(tokenizer_files, 2) as [(u1, w1), (u2, _)],
        router(workers=(u1,), admin_token=TOKEN, policy="round-robin", debug_headers=True) as base,
    ):
        wait_healthy(base, {u1})
        answer = put(base, workers=[u1, u2])
        assert answer.status_code == 200, answer.text
        assert answer.json()["joined"] == [u2] and answer.json()["left"] == []
        wait_healthy(base, {u1, u2})
        assert set(served_by(base, 4)) == {u1, u2}
        assert put(base, workers=[u2]).json()["left"] == [u1]
        before = len(w1.received)
        assert set(served_by(base, 4)) == {u2}
        assert len(w1.received) == before  # nothing more reached the worker that left


def test_membership_needs_the_admin_token_and_a_valid_set(tokenizer_files: TokenizerFiles) -> None:
    with fakes(tokenizer_files, 1) as [(u1, _)]:
        with router(workers=(u1,)) as base:  # no token configured: the set is the flags'
            refused = put(base, workers=[u1, dead_url()])
            assert refused.status_code == 403
            assert refused.json()["error"]["code"] == "membership_fixed"
        with router(workers=(u1,), admin_token=TOKEN) as base:
            assert put(base, token="wrong", workers=[u1]).status_code == 401
            assert put(base, token=None, workers=[u1]).status_code == 401
            assert put(base, workers=[u1, u1]).status_code == 400  # listed twice
            assert put(base, prefill=[u1]).status_code == 400  # prefill without decode
            assert put(base, workers="http://x").status_code == 400  # type: ignore[arg-type]
            bad = httpx.put(base + "/densa/workers", content=b"{", timeout=5,
                            headers={"authorization": f"Bearer {TOKEN}"})  # fmt: skip
            assert bad.status_code == 400
            # Nothing above changed the set.
            listed = httpx.get(base + "/densa/workers", headers=ADMIN).json()["workers"]
            assert [w["url"] for w in listed] == [u1]


def test_only_the_leaving_workers_sessions_move(tokenizer_files: TokenizerFiles) -> None:
    """Unit level: sessions stuck to a worker that leaves are forgotten, the others stay, the
    ring loses only that worker's points, a role change is a leave plus a join."""
    from densa.router.app import build_router
    from densa.router.config import RouterConfig

    urls = [f"http://w{i}:8000" for i in range(4)]
    rt: Router
    rt, _ = build_router(RouterConfig(workers=tuple(urls)))
    for i in range(200):
        rt.sessions.stick(f"s{i}", urls[i % 4])
    homes = {f"s{i}": rt.ring.owner(f"s{i}") for i in range(200)}
    change = apply_membership(rt, roles_from_body({"workers": urls[:3]}, has_secret=False))
    assert change.left == (urls[3],) and change.joined == ()
    assert all(rt.sessions.lookup(f"s{i}") == urls[i % 4] for i in range(200) if i % 4 != 3)
    assert all(rt.sessions.lookup(f"s{i}") is None for i in range(200) if i % 4 == 3)
    moved = [s for s, home in homes.items() if rt.ring.owner(s) != home]
    assert moved and all(homes[s] == urls[3] for s in moved)
    pools = {"prefill": [urls[0]], "decode": urls[1:3]}
    change = apply_membership(rt, roles_from_body(pools, has_secret=True))
    assert change.left == tuple(urls[:3]) and change.joined == tuple(urls[:3])  # roles changed
    assert rt.pool.workers[urls[0]].role == "prefill" and urls[0] not in rt.ring
    with pytest.raises(APIError):
        roles_from_body({"workers": [urls[0]], "extra": []}, has_secret=True)
