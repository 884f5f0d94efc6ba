"""The router's HTTP behaviour against fake workers: headers, pass-through of statuses and
bodies, retries only before the first byte, 503 when nobody can take a request, P/D headers."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from densa.auth.placement import PLACEMENT_HEADER, PlacementError, PlacementVerifier
from densa.auth.secret import ClusterSecret
from densa.ipc.messages import TokenizerFiles
from densa.router.app import build_router_app
from densa.router.config import RouterConfig
from densa.router.workers import HealthOptions
from densa.serve.process import serve_in_thread
from densa.text.tokenizer import read_tokenizer_files

from .fakes import FakeWorker

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def tokenizer_files(tiny_model_dir: Path) -> TokenizerFiles:
    return read_tokenizer_files(tiny_model_dir)


@contextlib.contextmanager
def fakes(files: TokenizerFiles, n: int) -> Iterator[list[tuple[str, FakeWorker]]]:
    with contextlib.ExitStack() as stack:
        workers = [FakeWorker(files) for _ in range(n)]
        yield [(stack.enter_context(serve_in_thread(w.app())), w) for w in workers]


@contextlib.contextmanager
def router(**config: object) -> Iterator[str]:
    with serve_in_thread(build_router_app(RouterConfig(**config))) as url:  # type: ignore[arg-type]
        yield url


def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens there once closed


def test_answers_name_the_worker_exactly_as_given_and_streams_pass_through(
    tokenizer_files: TokenizerFiles,
) -> None:
    with fakes(tokenizer_files, 1) as [(url, worker)]:
        given = url + "/"  # a trailing slash: the header repeats it as given
        with router(workers=(given,), debug_headers=True) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
            raw = client.chat.completions.with_raw_response.create(**CHAT)  # type: ignore[call-overload]
            assert raw.headers["x-densa-worker"] == given
            assert len(raw.headers.get_list("date")) == 1  # the router's, not also the worker's
            assert len(raw.headers.get_list("server")) == 1
            assert raw.parse().usage.completion_tokens == 3
            stream = client.chat.completions.create(**CHAT, stream=True)  # type: ignore[call-overload]
            texts = [c.choices[0].delta.content for c in stream]
            assert texts == ["t0 ", "t1 ", "t2 ", "t3 "]
        assert worker.received[0]["headers"]["authorization"] == "Bearer k"


def test_a_workers_cookie_reaches_its_client_but_never_another_clients_request(
    tokenizer_files: TokenizerFiles,
) -> None:
    with fakes(tokenizer_files, 1) as [(url, worker)]:
        worker.set_cookie = "sid=client-a-secret; Path=/"
        with router(workers=(url,)) as base:
            first = httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=10)
            assert first.headers["set-cookie"] == "sid=client-a-secret; Path=/"
            httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=10).raise_for_status()
        assert [r["headers"].get("cookie") for r in worker.received] == [None, None]


def test_429_and_4xx_bodies_pass_through_untouched_and_are_not_retried(
    tokenizer_files: TokenizerFiles,
) -> None:
    with fakes(tokenizer_files, 2) as [(u1, w1), (u2, w2)]:
        w1.mode = w2.mode = "429"
        with router(workers=(u1, u2)) as base:
            response = httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=10)
            assert response.status_code == 429 and response.headers["retry-after"] == "7"
            assert response.json()["error"]["code"] == "overloaded"
            assert len(w1.received) + len(w2.received) == 1
            w1.mode = w2.mode = "400"
            response = httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=10)
            assert response.status_code == 400
            assert response.content == b'{"error": {"message": "exactly these bytes"}}'


def test_a_refused_connection_or_a_503_moves_the_request_and_ejects_a_dead_worker(
    tokenizer_files: TokenizerFiles,
) -> None:
    slow_polls = HealthOptions(poll_interval_s=60)  # only the proxy can notice the death
    with fakes(tokenizer_files, 2) as [(u1, w1), (u2, _)]:
        w1.mode = "503"
        doomed = serve_in_thread(FakeWorker(tokenizer_files).app())
        dead = doomed.__enter__()
        admin = {"authorization": "Bearer admin-secret"}
        with router(workers=(dead, u1, u2), health=slow_polls, debug_headers=True,
                    admin_token="admin-secret") as base:  # fmt: skip
            assert _health_of(base, admin)[dead] is True
            doomed.__exit__(None, None, None)  # the admitted worker stops listening
            for _ in range(3):
                response = httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=10)
                assert response.status_code == 200
                assert response.headers["x-densa-worker"] == u2
            assert _health_of(base, admin) == {dead: False, u1: True, u2: True}
            metrics = httpx.get(base + "/metrics", timeout=5).text
            assert 'densa_router_retries_total{reason="worker_unavailable"}' in metrics
            assert 'densa_router_retries_total{reason="connect"} 1.0' in metrics
            assert (
                f'densa_router_ejections_total{{reason="connect",worker="{dead}"}} 1.0' in metrics
            )
            assert f'densa_router_worker_healthy{{worker="{dead}"}} 0.0' in metrics


def _health_of(base: str, admin: dict[str, str]) -> dict[str, bool]:
    listed = httpx.get(base + "/densa/workers", headers=admin, timeout=5).json()["workers"]
    return {w["url"]: w["healthy"] for w in listed}


def test_the_public_health_check_names_no_worker(tokenizer_files: TokenizerFiles) -> None:
    """/health is open to every client: status and model only. The worker URLs (the internal
    plane's topology) are listed only to the admin token (before: every URL in /health)."""
    with (
        fakes(tokenizer_files, 2) as [(u1, _), (u2, _)],
        router(workers=(u1, u2), admin_token="admin-secret") as base,
    ):
        response = httpx.get(base + "/health", timeout=5)
        assert response.status_code == 200
        assert set(response.json()) == {"status", "model"}
        assert "127.0.0.1" not in response.text
        assert httpx.get(base + "/densa/workers", timeout=5).status_code == 401
        admin = {"authorization": "Bearer admin-secret"}
        assert set(_health_of(base, admin)) == {u1, u2}


def test_no_worker_left_is_a_503_with_retry_after(tokenizer_files: TokenizerFiles) -> None:
    with fakes(tokenizer_files, 2) as [(u1, w1), (u2, w2)]:
        w1.mode = w2.mode = "503"
        with router(workers=(u1, u2)) as base:
            response = httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=10)
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "no_worker_available"
            assert len(w1.received) == len(w2.received) == 1  # each tried once
    with router(workers=(dead_url(),)) as base:
        assert httpx.get(base + "/health", timeout=5).status_code == 503
        response = httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 503


def test_a_worker_lost_mid_stream_ends_the_stream_with_an_explicit_error(
    tokenizer_files: TokenizerFiles,
) -> None:
    with fakes(tokenizer_files, 1) as [(url, worker)]:
        worker.mode = "die_mid_stream"
        with router(workers=(url,)) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
            texts = []
            with pytest.raises(openai.APIError, match="was lost") as lost:
                for chunk in client.chat.completions.create(**CHAT, stream=True):  # type: ignore[call-overload]
                    texts.append(chunk.choices[0].delta.content)
            assert texts == ["t0 ", "t1 "]
            # The workers' addresses are the internal plane's: the client learns none of them.
            host_port = url.removeprefix("http://")
            assert host_port not in str(lost.value) and host_port not in str(lost.value.body)


def test_pd_mode_forwards_to_the_decode_worker_naming_the_prefill_worker_signed(
    tokenizer_files: TokenizerFiles,
) -> None:
    secret = ClusterSecret.generate()
    with fakes(tokenizer_files, 3) as [(p, wp), (d1, wd1), (d2, wd2)]:
        wd1.num_free_kv_pages = 10  # d2 has more room
        with router(prefill=(p,), decode=(d1, d2), secret=secret, debug_headers=True) as base:
            response = httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=10)
            assert response.status_code == 200
            assert response.headers["x-densa-worker"] == d2
            assert response.headers["x-densa-prefill"] == p
        assert wp.received == [] and wd1.received == []
        sent = wd2.received[0]["headers"]
        assert sent["x-densa-prefill"] == p
        # The token authorizes exactly this prefill worker, under exactly this secret.
        PlacementVerifier(secret).verify(sent[PLACEMENT_HEADER], p)
        with pytest.raises(PlacementError):
            PlacementVerifier(secret).verify(sent[PLACEMENT_HEADER], d1)
        with pytest.raises(PlacementError):
            PlacementVerifier(ClusterSecret.generate()).verify(sent[PLACEMENT_HEADER], p)


def test_a_client_that_disconnects_mid_stream_closes_the_workers_stream(
    tokenizer_files: TokenizerFiles,
) -> None:
    import time

    with fakes(tokenizer_files, 1) as [(url, worker)]:
        worker.mode = "endless"
        with router(workers=(url,)) as base:
            body = {**CHAT, "stream": True}
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=10) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
            deadline = time.monotonic() + 5
            while worker.num_streams_closed == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert worker.num_streams_closed == 1
            sent = worker.num_chunks_sent
            time.sleep(0.3)
            assert worker.num_chunks_sent == sent < 1000  # nothing generated for nobody
            health = httpx.get(base + "/metrics", timeout=5).text
            assert f'densa_router_worker_open_requests{{worker="{url}"}} 0.0' in health
