"""The HTTP side of prefill/decode disaggregation (docs/disaggregation.md).

A router sends an OpenAI request to a decode worker with the header `x-densa-prefill: <URL of a
prefill worker>`. The decode worker's front asks that URL once for its KV transfer address
(GET /disagg/peer, cached) and hands it to its engine with the request; the engines then talk
directly (densa/disagg). Torch-free, like the rest of the front.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from densa.serve.errors import APIError, bad_request

PREFILL_HEADER = "x-densa-prefill"
PEER_PATH = "/disagg/peer"
_LOOKUP_TIMEOUT_S = 5.0
_CACHE_S = 2.0  # a prefill worker restarted on the same URL gets a new KV port: look again soon

disagg_router = APIRouter()


@disagg_router.get(PEER_PATH)
async def peer(request: Request) -> JSONResponse:
    """This worker's disaggregation role and, for a prefill worker, its KV transfer address."""
    served = request.app.state.densa.served
    body = {"role": served.role, "kv_address": served.kv_address, "model": served.name}
    return JSONResponse(body)


class PrefillPeers:
    """Prefill worker URL -> KV address, looked up over HTTP and cached for a while."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[float, str]] = {}

    async def kv_address(self, url: str) -> str:
        cached = self._cache.get(url)
        if cached is not None and time.monotonic() - cached[0] < _CACHE_S:
            return cached[1]
        info = await asyncio.to_thread(_fetch, url.rstrip("/") + PEER_PATH)
        if info.get("role") != "prefill" or not info.get("kv_address"):
            raise _bad_gateway(f"{url} is not a prefill worker (its role is {info.get('role')!r})")
        address = str(info["kv_address"])
        self._cache[url] = (time.monotonic(), address)
        return address


async def prefill_address(request: Request, role: str, peers: PrefillPeers) -> str:
    """The KV address of the prefill worker the request names, or "" to run it here."""
    url = request.headers.get(PREFILL_HEADER)
    if not url:
        return ""
    if role != "decode":
        raise bad_request(
            f"this server's role is {role!r}: only a decode worker (--role decode) takes "
            f"{PREFILL_HEADER}"
        )
    if not url.startswith(("http://", "https://")):
        raise bad_request(f"{PREFILL_HEADER} must be an http(s) URL of a prefill worker")
    return await peers.kv_address(url)


# Workers talk to each other directly: a proxy from the environment (http_proxy) must not apply.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _fetch(url: str) -> dict[str, Any]:
    try:
        with _OPENER.open(url, timeout=_LOOKUP_TIMEOUT_S) as response:
            info = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise _bad_gateway(f"the prefill worker at {url} did not answer: {exc}") from exc
    if not isinstance(info, dict):
        raise _bad_gateway(f"the prefill worker at {url} answered {info!r}")
    return info


def _bad_gateway(message: str) -> APIError:
    return APIError(502, message, code="kv_peer_unreachable", error_type="server_error")
