"""The decode worker's outbound lookup of a prefill worker (serve/disagg.py): who may trigger it
(PlacementPolicy) and how far a hostile answer can go (PrefillPeers), against real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from densa.auth.placement import sign_placement
from densa.auth.secret import ClusterSecret
from densa.openai.errors import APIError
from densa.serve.disagg import MAX_ANSWER_BYTES, PlacementPolicy, PrefillPeers, peer_base_url

SECRET = ClusterSecret(b"lookup-tests-cluster-secret-0123")
GOOD = b'{"role": "prefill", "kv_address": "tcp://127.0.0.1:5555", "model": "tiny"}'


@contextlib.contextmanager
def http_peer(answer: Callable[[socket.socket], None]) -> Iterator[tuple[str, list[bytes]]]:
    """A loopback server whose every connection is handled by `answer`; yields its URL and the
    requests it received."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                seen.append(conn.recv(4096))
                with contextlib.suppress(OSError):
                    answer(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", seen
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def respond(
    body: bytes, status: str = "200 OK", extra: str = ""
) -> Callable[[socket.socket], None]:
    def answer(conn: socket.socket) -> None:
        head = (
            f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n"
        )
        conn.sendall(head.encode() + body)

    return answer


def drip(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    for _ in range(50):  # a byte every 0.2 s: each read succeeds, the whole never ends
        conn.sendall(b" ")
        time.sleep(0.2)


def lookup(url: str, timeout_s: float = 1.0) -> str:
    async def run() -> str:
        peers = PrefillPeers(timeout_s=timeout_s)
        try:
            return await peers.kv_address(peer_base_url(url))
        finally:
            await peers.close()

    return asyncio.run(run())


def test_an_honest_prefill_worker_is_looked_up_at_its_peer_path_only() -> None:
    with http_peer(respond(GOOD)) as (url, seen):
        assert lookup(url) == "tcp://127.0.0.1:5555"
    assert seen[0].startswith(b"GET /disagg/peer HTTP/1.1")


@pytest.mark.parametrize(
    ("answer", "logged_only"),
    [
        (respond(b"", "302 Found", "Location: http://127.0.0.1:1/secret\r\n"), "302"),
        (respond(b'{"role": "decode", "kv_address": "tcp://a:1"}'), "not a prefill worker"),
        (respond(b'{"role": "prefill", "kv_address": "x"}'), "unusable KV address"),
        (respond(b'{"role": "prefill", "kv_address": "tcp://a:1; rm -rf"}'), "unusable"),
        (respond(b"secret internal page " * 1000), "over"),
        (respond(b"[1, 2]"), "JSON object"),
    ],
)
def test_hostile_answers_are_a_502_that_echoes_nothing(
    answer: Callable[[socket.socket], None], logged_only: str, caplog: pytest.LogCaptureFixture
) -> None:
    with http_peer(answer) as (url, seen), pytest.raises(APIError) as info:
        lookup(url)
    assert info.value.status_code == 502
    message = str(info.value)
    assert "secret" not in message and "rm -rf" not in message and "302" not in message
    assert logged_only in caplog.text  # the operator still learns why
    assert len(seen) == 1  # the redirect was not followed


def test_an_answer_larger_than_the_cap_is_not_read_to_the_end() -> None:
    assert len(b"x" * (MAX_ANSWER_BYTES + 1)) > MAX_ANSWER_BYTES
    with http_peer(respond(b"x" * (64 << 20))) as (url, _), pytest.raises(APIError):
        lookup(url)


def test_a_dripping_peer_is_cut_off_at_the_total_deadline() -> None:
    started = time.monotonic()
    with http_peer(drip) as (url, _), pytest.raises(APIError):
        lookup(url, timeout_s=0.5)
    assert time.monotonic() - started < 5  # the per-read timeout alone would wait ~10 s


def test_dripping_lookups_leave_the_thread_pool_to_tokenization() -> None:
    """The attack held 6 lookups on the default thread pool and starved tokenization; lookups
    now run on the event loop, so work sent to the pool still runs at once."""

    async def run(url: str) -> float:
        peers = PrefillPeers(timeout_s=3.0)
        lookups = [asyncio.ensure_future(peers.kv_address(url)) for _ in range(12)]
        await asyncio.sleep(0.3)  # every lookup connected and is being dripped on
        started = time.monotonic()
        await asyncio.gather(*(asyncio.to_thread(sum, range(1000)) for _ in range(8)))
        waited = time.monotonic() - started
        for task in lookups:
            task.cancel()
        await asyncio.gather(*lookups, return_exceptions=True)
        await peers.close()
        return waited

    with http_peer(drip) as (url, _):
        assert asyncio.run(run(url)) < 1.0


@pytest.mark.parametrize(
    "url",
    ["ftp://p:1", "http://p:1/other/path", "http://p:1#", "http://p:1/#/x", "http://u:pw@p:1",
     "http://p:1?x=1", "http://:1", "http://p:99999", "p:1", "javascript:alert(1)"],
)  # fmt: skip
def test_only_scheme_host_and_port_are_accepted_as_a_prefill_url(url: str) -> None:
    with pytest.raises(ValueError):
        peer_base_url(url)


def test_placement_needs_the_routers_signature_or_the_allowlist() -> None:
    url = "http://10.0.0.7:8001"
    policy = PlacementPolicy(SECRET, allowlist=["http://10.0.0.9:8001/"])
    policy.authorize(url, sign_placement(SECRET, url))
    policy.authorize("http://10.0.0.9:8001", None)  # the operator's own peer
    refusals = [
        (url, None),
        (url, "v1.abc.99999999999." + "0" * 64),
        (url, sign_placement(ClusterSecret(b"some-other-cluster-secret-012345"), url)),
        ("http://10.0.0.8:8001", sign_placement(SECRET, url)),  # a token moved to another URL
    ]
    for target, token in refusals:
        with pytest.raises(APIError) as info:
            policy.authorize(target, token)
        assert info.value.status_code == 403
    with pytest.raises(APIError, match="no cluster secret"):
        PlacementPolicy(None).authorize(url, sign_placement(SECRET, url))
