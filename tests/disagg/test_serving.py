"""1 prefill + 1 decode worker against one co-located server, through the official openai client:
greedy tokens identical alone and batched, streaming, stop strings, seeds, cached tokens; and
afterwards every page free on both sides, no integrity violation."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from densa.auth.placement import PLACEMENT_HEADER
from densa.serve.disagg import PREFILL_HEADER
from tests.serve.support import MODEL_NAME, RunningServer

from .conftest import placed

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "The three primary colors are",
    "In 1969, astronauts",
    "A recipe for bread: first,",
    "The quick brown fox",
    "Water boils at",
    "My favourite book is",
    "To be or not to be,",
    "The weather today is sunny and",
    "Photosynthesis converts light into",
]


def split(decode: RunningServer, prefill: RunningServer) -> dict[str, Any]:
    return {"extra_headers": placed(prefill.base_url)}


def complete(server: RunningServer, prompt: str, **kwargs: Any) -> Any:
    body = {"max_tokens": 12, "temperature": 0.0, **kwargs}
    return server.client().completions.create(model=MODEL_NAME, prompt=prompt, **body)


def assert_all_free(*servers: RunningServer) -> None:
    for server in servers:
        server.wait_idle(timeout=10)
        stats = server.stats
        assert stats.integrity_violations == {} or sum(stats.integrity_violations.values()) == 0
        assert stats.disagg.get("held_pages", 0) == 0 if stats.disagg else True


def test_greedy_tokens_match_one_server_alone_and_batched(
    reference: RunningServer, prefill: RunningServer, decode: RunningServer
) -> None:
    expected = [complete(reference, p).choices[0].text for p in PROMPTS]
    alone = [complete(decode, p, **split(decode, prefill)).choices[0].text for p in PROMPTS]
    assert alone == expected
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        batched = list(
            pool.map(
                lambda p: complete(decode, p, **split(decode, prefill)).choices[0].text, PROMPTS
            )
        )
    assert batched == expected
    assert decode.stats.disagg["transfers_landed"] >= 2 * len(PROMPTS)
    assert_all_free(prefill, decode)


def test_streaming_stop_strings_seeds_and_logprobs_behave_as_on_one_server(
    reference: RunningServer, prefill: RunningServer, decode: RunningServer
) -> None:
    def stream(server: RunningServer, **extra: Any) -> str:
        chunks = server.client().completions.create(
            model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=20, temperature=0.0, stream=True,
            **extra,
        )  # fmt: skip
        return "".join(c.choices[0].text for c in chunks if c.choices)

    assert stream(decode, **split(decode, prefill)) == stream(reference)
    full = complete(reference, PROMPTS[1], max_tokens=20).choices[0].text
    stop = full.strip().split()[2]
    stopped = complete(decode, PROMPTS[1], max_tokens=20, stop=[stop], **split(decode, prefill))
    assert (
        stopped.choices[0].text
        == complete(reference, PROMPTS[1], max_tokens=20, stop=[stop]).choices[0].text
    )
    assert stopped.choices[0].finish_reason == "stop"
    seeded = {"temperature": 0.9, "seed": 1234, "max_tokens": 16}
    assert (
        complete(decode, PROMPTS[2], **seeded, **split(decode, prefill)).choices[0].text
        == complete(reference, PROMPTS[2], **seeded).choices[0].text
    )
    with_lp = complete(decode, PROMPTS[3], logprobs=2, **split(decode, prefill)).choices[0].logprobs
    ref_lp = complete(reference, PROMPTS[3], logprobs=2).choices[0].logprobs
    assert with_lp.tokens == ref_lp.tokens
    assert with_lp.token_logprobs == pytest.approx(ref_lp.token_logprobs, abs=1e-4)
    assert_all_free(prefill, decode)


def test_cached_tokens_count_both_sides_and_only_missing_pages_move(
    prefill: RunningServer, decode: RunningServer
) -> None:
    shared = "Here is a long shared instruction that many requests begin with. " * 6
    first = complete(decode, shared + "Question one?", **split(decode, prefill))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    pages_before = decode.stats.disagg["pages"]
    # The same prefix again: decode caches it now (it landed there), and so does prefill.
    second = complete(decode, shared + "Question two?", **split(decode, prefill))
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * 4
    moved = decode.stats.disagg["pages"] - pages_before
    num_pages = -(-second.usage.prompt_tokens // 16)
    assert moved == num_pages - cached // 16  # only the pages decode did not hold
    # Prefill's cache alone: a prompt that only prefill has seen (it ran there directly).
    only_prefill = "A different preamble, computed on the prefill worker only. " * 5
    complete(prefill, only_prefill + "First.")
    third = complete(decode, only_prefill + "Second.", **split(decode, prefill))
    assert third.usage.prompt_tokens_details.cached_tokens >= 16 * 3
    assert_all_free(prefill, decode)


def test_the_header_on_a_non_decode_worker_is_a_clear_400(
    reference: RunningServer, prefill: RunningServer
) -> None:
    with pytest.raises(openai.BadRequestError, match="only a decode worker"):
        complete(reference, "Hi", **split(reference, prefill))


def test_a_prefill_url_that_is_not_a_prefill_worker_is_a_502(
    reference: RunningServer, decode: RunningServer
) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        complete(decode, "Hi", extra_headers=placed(reference.base_url))
    assert info.value.status_code == 502
    assert info.value.body["code"] == "kv_peer_unreachable"  # type: ignore[index]


def test_metrics_show_every_page_free_and_the_transfer_counters(
    prefill: RunningServer, decode: RunningServer
) -> None:
    complete(decode, PROMPTS[0], **split(decode, prefill))
    for server, role_counter in ((decode, "transfers_landed"), (prefill, "transfers_started")):
        server.wait_idle(timeout=10)
        text = httpx.get(server.base_url + "/metrics", timeout=5).text
        samples = dict(
            line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
        )
        assert samples["densa_kv_pages_free"] == samples["densa_kv_pages_total"]
        assert float(samples['densa_kv_transfer{name="held_pages"}']) == 0
        assert float(samples[f'densa_kv_transfer{{name="{role_counter}"}}']) >= 1
        assert not any(k.startswith("densa_kv_integrity_violations{") for k in samples)


def test_densa_serve_role_flags_start_real_workers_that_hand_off(
    tiny_model_dir: Path, reference: RunningServer, secret_file: Path
) -> None:
    """`densa serve --role prefill|decode` as a user runs them: two processes sharing the
    cluster secret, one answer; a request without the router's signed placement is refused."""
    ports = [free_port(), free_port()]
    secret = ("--cluster-secret-file", str(secret_file))
    processes = [
        start_cli(tiny_model_dir, ports[0], "--role", "prefill", *secret),
        start_cli(tiny_model_dir, ports[1], "--role", "decode", *secret),
    ]
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url in urls:
            wait_healthy(url)
        peer = httpx.get(urls[0] + "/disagg/peer", timeout=5).json()
        assert peer["role"] == "prefill" and peer["kv_address"].startswith("tcp://127.0.0.1:")
        request = {"model": MODEL_NAME, "prompt": PROMPTS[4], "max_tokens": 12, "temperature": 0}
        unsigned = httpx.post(urls[1] + "/v1/completions", json=request,
                              headers={PREFILL_HEADER: urls[0]}, timeout=60)  # fmt: skip
        assert unsigned.status_code == 403
        answer = httpx.post(
            urls[1] + "/v1/completions", json=request, headers=placed(urls[0]), timeout=60
        ).json()
        assert answer["choices"][0]["text"] == complete(reference, PROMPTS[4]).choices[0].text
    finally:
        for process in processes:
            process.send_signal(signal.SIGINT)
        for process in processes:
            process.wait(30)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_cli(model_dir: Path, port: int, *flags: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "densa.cli", "--log-level", "warning", "serve",
               "--model", str(model_dir), "--served-model-name", MODEL_NAME, "--port", str(port),
               "--kv-cache-memory", "32MiB", "--max-model-len", "512", *flags]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_healthy(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"{url} did not become healthy")


@pytest.mark.parametrize(
    "headers",
    [
        {PREFILL_HEADER: "TRAP"},  # no token: any HTTP client can send the header
        {PREFILL_HEADER: "TRAP", "x-densa-placement": "v1.abc.99999999999." + "0" * 64},
        {PREFILL_HEADER: "TRAP#"},  # the trailing '#' that chose the whole path
        {PREFILL_HEADER: "TRAP/metrics"},
    ],
)
def test_a_client_cannot_make_the_decode_worker_connect_anywhere(
    decode: RunningServer, headers: dict[str, str]
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as trap:
        trap.settimeout(0.5)
        url = f"http://127.0.0.1:{trap.getsockname()[1]}"
        sent = {name: value.replace("TRAP", url) for name, value in headers.items()}
        response = httpx.post(decode.base_url + "/v1/completions", headers=sent, timeout=30,
                              json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})  # fmt: skip
        assert response.status_code in (400, 403)
        assert response.json()["error"]["param"] == PREFILL_HEADER
        with pytest.raises(TimeoutError):
            trap.accept()  # nobody connected


# Tokens a client may send that str.isdigit() / isalnum() took for well-formed (they were a 500
# with a 9 KB traceback each): as header bytes, which the server reads as Latin-1.
MALFORMED_TOKENS = [
    b"v1.ab12.\xb2." + b"0" * 64,  # the expiry "\u00b2"
    b"v1.ab12.1." + b"\xe9" * 64,  # a non-ASCII MAC
    b"v1.\xe9b12.1." + b"0" * 64,  # a non-ASCII placement id
    b"v1.ab12.99999999999." + b"0" * 63 + b"\xff",
    "v1.ab12.\u0661\u0662.".encode() + b"0" * 64,  # Arabic-Indic digits, as UTF-8 bytes
]


def _lines_of(caplog: pytest.LogCaptureFixture, request_id: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if request_id in r.getMessage()]


@pytest.mark.parametrize("token", MALFORMED_TOKENS)
def test_a_malformed_placement_token_is_a_403_with_one_log_line(
    decode: RunningServer, token: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    # configure_logging (a CLI run in this process) may have stopped "densa" propagating and
    # raised its level: listen on it directly, at INFO, for this test.
    densa_logger = logging.getLogger("densa")
    if not densa_logger.propagate:
        densa_logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="densa")
    caplog.set_level(logging.INFO, logger="densa.requests")  # (whatever an earlier test set)
    try:
        headers = {PREFILL_HEADER: b"http://127.0.0.1:9", PLACEMENT_HEADER: token}
        response = httpx.post(decode.base_url + "/v1/completions", headers=headers, timeout=30,
                              json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})  # fmt: skip
        decode.wait_idle()
        request_id = response.headers["x-request-id"]
        # The request's line is written as its response ends, on the server's thread: the
        # client may see the response first (a loaded machine did).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not _lines_of(caplog, request_id):
            time.sleep(0.05)
    finally:
        densa_logger.removeHandler(caplog.handler)
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("placement_not_authorized", PREFILL_HEADER)
    assert "malformed" in error["message"]
    lines = _lines_of(caplog, request_id)
    assert len(lines) == 1 and "\n" not in lines[0] and "status=403" in lines[0], lines
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_landed_pages_are_reused_by_the_same_tenant_never_by_another(
    prefill: RunningServer, decode: RunningServer
) -> None:
    """The paired isolation check across the split: pages a transfer landed (and the prefill
    worker's own cache) serve a later request of the same scope, and no other scope's."""
    prompt = "An isolation check: " + "the lighthouse keeper counts the waves. " * 8

    def cached(user: str) -> int:
        answer = complete(decode, prompt, user=user, **split(decode, prefill))
        return int(answer.usage.prompt_tokens_details.cached_tokens or 0)

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # the same text, another scope: nothing reused
    assert cached("tenant-a") >= 16  # the same scope: at least one full page reused
