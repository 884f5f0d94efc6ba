"""The router at the trust boundary (docs/routing.md#the-trust-boundary): clients cannot send
internal headers on, cannot reach any path of a worker but the ones the router forwards, learn
the workers' addresses and the router's timing only with --debug-headers, and cannot list the
worker set without the admin token; P/D pools need the cluster secret; a worker's text never
becomes a metrics label; another tenant's text is never cached for you."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.datastructures import Headers

from densa.auth.secret import SECRET_ENV, ClusterSecret
from densa.cli import main
from densa.ipc.messages import TokenizerFiles
from densa.openai.tools.formats import tool_format
from densa.router.app import model_path
from densa.router.config import RouterConfig
from densa.router.incoming import CHAT as CHAT_ENDPOINT
from densa.router.incoming import ModelInfo, read_incoming
from densa.router.metrics import RouterMetrics
from densa.router.tokens import PieceCachingTokenizer
from densa.router.workers import HealthOptions
from densa.text.tokenizer import Tokenizer, read_tokenizer_files

from .test_proxy import CHAT, fakes, router

TOKEN = "admin-token"
HOSTILE = {"x-densa-prefill": "http://evil:1", "x-densa-placement": "v1.a.1.b",
           "X-Densa-Anything": "x", "x-session-affinity": "s1"}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer_files(tiny_model_dir: Path) -> TokenizerFiles:
    return read_tokenizer_files(tiny_model_dir)


def internal(headers: dict[str, str] | httpx.Headers) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower().startswith("x-densa-")}


# ---- headers ------------------------------------------------------------------------------------
def test_client_x_densa_headers_never_reach_a_mixed_worker(tokenizer_files: TokenizerFiles) -> None:
    with fakes(tokenizer_files, 1) as [(url, worker)], router(workers=(url,)) as base:
        response = httpx.post(base + "/v1/chat/completions", json=CHAT, headers=HOSTILE,
                              timeout=10)  # fmt: skip
        assert response.status_code == 200
    sent = worker.received[0]["headers"]
    assert internal(sent) == {}
    assert sent["x-session-affinity"] == "s1"  # a public header still goes on


def test_a_decode_worker_gets_only_the_routers_own_prefill_and_token(
    tokenizer_files: TokenizerFiles,
) -> None:
    secret = ClusterSecret.generate()
    with (
        fakes(tokenizer_files, 2) as [(p, _), (d, wd)],
        router(prefill=(p,), decode=(d,), secret=secret) as base,
    ):
        httpx.post(base + "/v1/chat/completions", json=CHAT, headers=HOSTILE,
                   timeout=10).raise_for_status()  # fmt: skip
    sent = internal(wd.received[0]["headers"])
    assert set(sent) == {"x-densa-prefill", "x-densa-placement"}
    assert sent["x-densa-prefill"] == p
    assert sent["x-densa-placement"] != HOSTILE["x-densa-placement"]


def test_worker_and_timing_headers_only_with_debug_headers(tokenizer_files: TokenizerFiles) -> None:
    with fakes(tokenizer_files, 1) as [(url, worker)]:
        worker.answer_headers = {"x-densa-engine": "internal"}
        with router(workers=(url,)) as base:
            answer = httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=10)
            stream = httpx.post(base + "/v1/chat/completions", json={**CHAT, "stream": True},
                                timeout=10)  # fmt: skip
            models = httpx.get(base + "/v1/models", timeout=10)
            assert answer.status_code == stream.status_code == models.status_code == 200
            for response in (answer, stream, models):
                assert internal(response.headers) == {}
        with router(workers=(url,), debug_headers=True) as base:
            answer = httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=10)
            assert set(internal(answer.headers)) == {"x-densa-worker", "x-densa-router-ms"}
            assert httpx.get(base + "/v1/models", timeout=10).headers["x-densa-worker"] == url


# ---- paths --------------------------------------------------------------------------------------
def raw_get(base: str, target: str) -> tuple[int, bytes]:
    """GET with the request target exactly as written (HTTP clients resolve dot segments)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.parametrize(
    "target",
    ["/v1/models/../../metrics", "/v1/models/..%2F..%2Fmetrics", "/v1/models/%2E%2E/%2E%2E/metrics",
     "/v1/models/..", "/v1/models/../../densa/load", "/v1/models/tiny/../../../metrics"],
)  # fmt: skip
def test_a_model_id_never_reaches_another_path_of_a_worker(
    tokenizer_files: TokenizerFiles, target: str
) -> None:
    with fakes(tokenizer_files, 1) as [(url, worker)], router(workers=(url,)) as base:
        status, body = raw_get(base, target)
    assert b"densa_worker_secret_metric" not in body and b"num_free_kv_pages" not in body
    assert status == 404
    assert all(path.startswith("/v1/models/") for path in worker.paths), worker.paths


def test_model_ids_travel_as_one_encoded_segment(tokenizer_files: TokenizerFiles) -> None:
    assert model_path("tiny") == "/v1/models/tiny"
    assert model_path("org/model-1.5") == "/v1/models/org%2Fmodel-1%2E5"
    assert model_path("../../metrics") == "/v1/models/%2E%2E%2F%2E%2E%2Fmetrics"
    assert model_path("a?b#c d") == "/v1/models/a%3Fb%23c%20d"
    with fakes(tokenizer_files, 1) as [(url, worker)], router(workers=(url,)) as base:
        assert httpx.get(base + "/v1/models/tiny", timeout=10).json()["id"] == "tiny"
        assert httpx.get(base + "/v1/models/a%3Fb", timeout=10).status_code == 404
    assert worker.paths == ["/v1/models/tiny", "/v1/models/a?b"]  # the worker's decoded view


# ---- membership and secrets ---------------------------------------------------------------------
def test_listing_the_workers_needs_the_admin_token(tokenizer_files: TokenizerFiles) -> None:
    with fakes(tokenizer_files, 1) as [(url, _)]:
        with router(workers=(url,)) as base:
            refused = httpx.get(base + "/densa/workers", timeout=5)
            assert refused.status_code == 403 and url not in refused.text
        with router(workers=(url,), admin_token=TOKEN) as base:
            for auth in ({}, {"authorization": "Bearer wrong"}):
                refused = httpx.get(base + "/densa/workers", headers=auth, timeout=5)
                assert refused.status_code == 401 and url not in refused.text
            listed = httpx.get(base + "/densa/workers", timeout=5,
                               headers={"authorization": f"Bearer {TOKEN}"})  # fmt: skip
            assert [w["url"] for w in listed.json()["workers"]] == [url]


def test_pd_pools_need_the_cluster_secret(
    tokenizer_files: TokenizerFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="--cluster-secret-file"):
        RouterConfig(prefill=("http://p:1",), decode=("http://d:1",))
    pd = ["--prefill", "http://p:1", "--decode", "http://d:1"]
    assert main(["router", *pd]) == 2
    err = capsys.readouterr().err
    assert err.startswith("densa router: error:") and "cluster secret" in err
    assert main(["router", *pd, "--cluster-secret-file", str(tmp_path / "none")]) == 2
    assert "cannot read the cluster secret file" in capsys.readouterr().err
    # A PUT cannot add pools the router could not sign placements for.
    pools = {"prefill": ["http://p:1"], "decode": ["http://d:1"]}
    with fakes(tokenizer_files, 1) as [(url, _)], router(workers=(url,), admin_token=TOKEN) as base:
        refused = httpx.put(base + "/densa/workers", json=pools, timeout=5,
                            headers={"authorization": f"Bearer {TOKEN}"})  # fmt: skip
        assert refused.status_code == 400 and "cluster secret" in refused.text


def test_the_secret_comes_from_the_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from densa.router.cli import config_from

    secret, path = ClusterSecret.generate(), tmp_path / "secret"
    secret.write(path)
    pd = ["router", "--prefill", "http://p:1", "--decode", "http://d:1"]
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert config_from(parse([*pd, "--cluster-secret-file", str(path)])).secret == secret
    monkeypatch.setenv(SECRET_ENV, secret.value.decode())
    config = config_from(parse(pd))
    assert config.secret == secret and not config.debug_headers
    assert secret.value.decode() not in repr(config)
    assert config_from(parse([*pd, "--debug-headers"])).debug_headers


def parse(argv: list[str]) -> Any:
    import argparse

    from densa.router.cli import add_router_parser

    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers())
    return parser.parse_args(argv)


# ---- metrics ------------------------------------------------------------------------------------
def test_a_workers_error_text_never_becomes_a_metrics_label(
    tokenizer_files: TokenizerFiles,
) -> None:
    metrics = RouterMetrics(lambda: [])
    metrics.count_retry('kv_peer_mismatch: a "peer" said\nthis')
    metrics.count_ejection("http://w:1", "connection failed: ConnectError('refused')")
    metrics.count_response("http://w:1", 999)
    text = metrics.render().decode()
    assert 'densa_router_retries_total{reason="other"} 1.0' in text
    assert 'densa_router_ejections_total{reason="other",worker="http://w:1"} 1.0' in text
    assert 'densa_router_requests_total{status="other",worker="http://w:1"} 1.0' in text
    assert "peer" not in text and "refused" not in text
    with fakes(tokenizer_files, 1) as [(url, worker)]:
        worker.load_status = 500  # its error body is hostile text
        options = HealthOptions(poll_interval_s=0.05, backoff_base_s=0.05, max_backoff_s=0.1)
        with router(workers=(url,), health=options) as base:
            worker.load_status = 200
            deadline = time.monotonic() + 10
            while "densa_router_worker_healthy" not in (page := metrics_page(base)) or (
                f'densa_router_worker_healthy{{worker="{url}"}} 1.0' not in page
            ):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            worker.load_status = 500
            while "densa_router_ejections_total{" not in (page := metrics_page(base)):
                assert time.monotonic() < deadline
                time.sleep(0.05)
    assert f'densa_router_ejections_total{{reason="poll_status",worker="{url}"}} 1.0' in page
    assert "evil" not in page and "injected_metric" not in page


def metrics_page(base: str) -> str:
    return httpx.get(base + "/metrics", timeout=5).text


# ---- timing: the piece cache --------------------------------------------------------------------
async def test_another_tenants_text_is_a_piece_cache_miss(
    smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = read_tokenizer_files(smollm2_dir)
    tokenizer = PieceCachingTokenizer(files)
    model = ModelInfo("m", 4096, 16, tokenizer, tool_format("hermes"))
    system = "You are the support assistant of the Acme Rocket Company. " * 20
    body = httpx.Request("POST", "http://x", json={
        "model": "m", "messages": [{"role": "system", "content": system},
                                   {"role": "user", "content": "Hi"}],
    }).content  # fmt: skip
    encoded: list[str] = []
    full_encode = Tokenizer.encode

    def counting(self: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
        encoded.append(text)
        return full_encode(self, text, add_special_tokens)

    monkeypatch.setattr(Tokenizer, "encode", counting)

    async def read(key: str) -> list[int]:
        headers = Headers({"authorization": f"Bearer {key}"})
        incoming = await read_incoming(CHAT_ENDPOINT, body, headers, model)
        assert incoming.prompt_ids is not None
        return incoming.prompt_ids

    def system_misses() -> int:
        return sum(system.strip() in text for text in encoded)

    ids_a = await read("key-a")
    assert system_misses() == 1  # tenant A's first sight
    assert await read("key-a") == ids_a and system_misses() == 1  # A again: a hit
    assert await read("key-b") == ids_a and system_misses() == 2  # B: a miss, as if never seen
    assert await read("key-b") == ids_a and system_misses() == 2  # B again: B's own hit
