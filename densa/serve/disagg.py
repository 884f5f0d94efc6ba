"""The HTTP side of prefill/decode disaggregation (docs/disaggregation.md, docs/security.md).

A router sends an OpenAI request to a decode worker with `x-densa-prefill: <URL of a prefill
worker>` and `x-densa-placement: <token>`, a token it signed for that URL with the cluster
secret (densa/auth/placement.py). Headers come from the public plane, so the worker acts on the
URL only when the token verifies, or when the URL is on its own allowlist (`--prefill-peer`);
otherwise the request is refused with 403 before any outbound connection. The decode worker's
front then asks that URL once for its KV transfer address (GET /disagg/peer, cached) and hands it
to its engine with the request; the engines then talk directly (densa/disagg), over a link
authenticated with the same secret. Torch-free, like the rest of the front.

The lookup is bounded as an outbound call from a server must be: no redirects, no proxy from the
environment, a total deadline, a size cap on the answer, a cap on lookups in flight (it runs on
the event loop, never on the thread pool that tokenizes prompts), and nothing the peer said
(body, error) is echoed to the client.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.parse
from collections.abc import Iterable
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from densa.auth.placement import PLACEMENT_HEADER, PlacementError, PlacementVerifier
from densa.auth.secret import ClusterSecret
from densa.openai.errors import APIError, bad_request
from densa.utils.logging import get_logger

logger = get_logger(__name__)

PREFILL_HEADER = "x-densa-prefill"
PEER_PATH = "/disagg/peer"
LOOKUP_TIMEOUT_S = 5.0  # the whole lookup: connect, send, every byte of the answer
MAX_ANSWER_BYTES = 4096  # a /disagg/peer answer is ~100 bytes
MAX_LOOKUPS_IN_FLIGHT = 8  # more wait (each still under its own deadline)
_CACHE_S = 2.0  # a prefill worker restarted on the same URL gets a new KV port: look again soon
_MAX_CACHED = 256
# What a prefill worker may announce as its KV address: the ZeroMQ endpoints it binds.
_KV_ADDRESS = re.compile(r"^(tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):\d{1,5}|ipc://[\w./-]+)$")

disagg_router = APIRouter()


@disagg_router.get(PEER_PATH)
async def peer(request: Request) -> JSONResponse:
    """This worker's disaggregation role and, for a prefill worker, its KV transfer address."""
    served = request.app.state.densa.served
    body = {"role": served.role, "kv_address": served.kv_address, "model": served.name}
    return JSONResponse(body)


class PlacementPolicy:
    """Who may name this decode worker's prefill worker: the router (a token signed with the
    cluster secret) or the operator (the allowlist). Nobody else."""

    def __init__(self, secret: ClusterSecret | None = None, allowlist: Iterable[str] = ()) -> None:
        self._verifier = None if secret is None else PlacementVerifier(secret)
        self._allowlist = {peer_base_url(url) for url in allowlist}

    def authorize(self, url: str, token: str | None) -> None:
        """Raise 403 unless the request may reach `url`."""
        if peer_base_url(url) in self._allowlist:
            return
        if self._verifier is None:
            raise _forbidden("this worker has no cluster secret and the prefill worker is not "
                             "on its --prefill-peer allowlist")  # fmt: skip
        if not token:
            raise _forbidden(f"a prefill worker is named without the router's {PLACEMENT_HEADER}")
        try:
            self._verifier.verify(token, url)
        except PlacementError as exc:
            raise _forbidden(f"the placement is not signed by the router ({exc.reason})") from exc


def peer_base_url(url: str) -> str:
    """`scheme://host[:port]` of a prefill worker's URL; ValueError for anything else (a path,
    a query, a fragment, credentials: nothing a client could use to choose what is fetched)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("not an http(s) URL with a host")
    if parts.username or parts.password or parts.query or parts.fragment or "#" in url:
        raise ValueError("credentials, a query or a fragment")
    if parts.path not in ("", "/"):
        raise ValueError("a path")
    _ = parts.port  # raises ValueError for a port out of range
    return f"{parts.scheme}://{parts.netloc.lower()}"


class PrefillPeers:
    """Prefill worker URL -> KV address, looked up over HTTP and cached for a while."""

    def __init__(self, timeout_s: float = LOOKUP_TIMEOUT_S) -> None:
        self._cache: dict[str, tuple[float, str]] = {}
        self._timeout_s = timeout_s
        self._in_flight = asyncio.Semaphore(MAX_LOOKUPS_IN_FLIGHT)
        # trust_env=False: a proxy from the environment (http_proxy) must not apply between
        # workers; follow_redirects=False: the answer must come from the URL that was signed.
        self._client = httpx.AsyncClient(trust_env=False, follow_redirects=False)

    async def kv_address(self, base_url: str) -> str:
        cached = self._cache.get(base_url)
        if cached is not None and time.monotonic() - cached[0] < _CACHE_S:
            return cached[1]
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._in_flight:
                    info = await self._fetch(base_url + PEER_PATH)
        except (TimeoutError, httpx.HTTPError, OSError, ValueError) as exc:
            logger.warning("prefill worker lookup at %r failed: %r", base_url, exc)
            raise _bad_gateway() from exc
        address = info.get("kv_address")
        if info.get("role") != "prefill" or not isinstance(address, str):
            logger.warning("%r answered the lookup but is not a prefill worker", base_url)
            raise _bad_gateway()
        if not _KV_ADDRESS.match(address):
            logger.warning("%r announced an unusable KV address %r", base_url, address[:200])
            raise _bad_gateway()
        if len(self._cache) >= _MAX_CACHED:
            self._cache.clear()
        self._cache[base_url] = (time.monotonic(), address)
        return address

    async def _fetch(self, url: str) -> dict[str, Any]:
        async with self._client.stream("GET", url) as response:
            if response.status_code != 200:
                raise ValueError(f"status {response.status_code}")
            body = b""
            async for chunk in response.aiter_raw():
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    raise ValueError(f"an answer over {MAX_ANSWER_BYTES} bytes")
        info = json.loads(body)
        if not isinstance(info, dict):
            raise ValueError("not a JSON object")
        return info

    async def close(self) -> None:
        await self._client.aclose()


async def prefill_address(
    request: Request, role: str, peers: PrefillPeers, policy: PlacementPolicy
) -> str:
    """The KV address of the prefill worker the request names, or "" to run it here."""
    url = request.headers.get(PREFILL_HEADER)
    if not url:
        return ""
    if role != "decode":
        raise bad_request(
            f"this server's role is {role!r}: only a decode worker (--role decode) takes "
            f"{PREFILL_HEADER}",
            param=PREFILL_HEADER,
        )
    try:
        base_url = peer_base_url(url)
    except ValueError as exc:
        raise bad_request(
            f"{PREFILL_HEADER} must be the http(s) URL of a prefill worker, scheme://host:port "
            f"and nothing more ({exc})",
            param=PREFILL_HEADER,
        ) from exc
    policy.authorize(url, request.headers.get(PLACEMENT_HEADER))
    return await peers.kv_address(base_url)


def _forbidden(message: str) -> APIError:
    return APIError(403, message, code="placement_not_authorized", param=PREFILL_HEADER,
                    error_type="permission_error")  # fmt: skip


def _bad_gateway() -> APIError:
    # The peer's own words (a body, a connection error) stay in this worker's log.
    message = "the prefill worker chosen for this request did not answer its peer lookup"
    return APIError(502, message, code="kv_peer_unreachable", error_type="server_error")
