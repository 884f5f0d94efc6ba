"""The router's worker set, replaced while it serves (`densa cluster` moves workers around).

    PUT /densa/workers   {"workers": [...], "prefill": [...], "decode": [...]}
                         Authorization: Bearer <the token in $DENSA_ROUTER_ADMIN_TOKEN>
    GET /densa/workers   the set, each worker's role and health (the same token: the set is
                         the internal plane's addresses, not something to tell any client)

A PUT names the whole new set. A URL that joins starts out of rotation and is admitted by its
first good load poll, exactly as at start-up. A URL that leaves goes at once: its sessions are
forgotten and its ring points removed, so only *its* sessions re-home (consistent hashing); a
response already streaming from it finishes. A URL whose role changed leaves and joins again.
Without $DENSA_ROUTER_ADMIN_TOKEN the set is the command line's and a PUT answers 403: a
router's routing table is not something any client may rewrite (or read).

Prefill and decode pools need the router to hold the cluster secret (RouterConfig.secret): a
decode worker acts on a placement only if the router signed it, so a set with a decode pool and
no secret could serve nothing, and is refused at start-up and on a PUT alike.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

from densa.auth.secret import SECRET_ENV
from densa.openai.errors import APIError
from densa.router.prefix import WorkerPrefixIndex
from densa.router.routing import Router
from densa.router.workers import Worker
from densa.utils.logging import get_logger

logger = get_logger(__name__)
ADMIN_TOKEN_ENV = "DENSA_ROUTER_ADMIN_TOKEN"
POOL_KEYS = {"workers": "mixed", "prefill": "prefill", "decode": "decode"}  # body key -> role


@dataclass(frozen=True)
class MembershipChange:
    joined: tuple[str, ...]
    left: tuple[str, ...]


def check_pools(
    workers: list[str], prefill: list[str], decode: list[str], has_secret: bool
) -> None:
    """The rules every worker set follows, at start-up and on a PUT (ValueError names the rule)."""
    urls = [*workers, *prefill, *decode]
    if bool(prefill) != bool(decode):
        raise ValueError("prefill and decode pools come together: give both or neither")
    if decode and not has_secret:
        raise ValueError(
            "prefill and decode pools need the cluster secret, to sign each placement the "
            "decode workers act on: start the router with --cluster-secret-file FILE (or "
            f"${SECRET_ENV}), the same secret the workers were given"
        )
    if len(set(urls)) != len(urls):
        raise ValueError("a worker URL is listed twice; give each worker once")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"worker URL {url!r} must start with http:// or https://")


def roles_from_body(body: Any, has_secret: bool) -> dict[str, str]:
    """A PUT body -> url -> role (400 on anything malformed)."""
    if not isinstance(body, dict) or not set(body) <= set(POOL_KEYS):
        raise APIError(400, f"the body must be an object with keys among {sorted(POOL_KEYS)}")
    pools: dict[str, list[str]] = {}
    for key in POOL_KEYS:
        urls = body.get(key, [])
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise APIError(400, f"{key!r} must be a list of URLs", param=key)
        pools[key] = urls
    try:
        check_pools(pools["workers"], pools["prefill"], pools["decode"], has_secret)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    return {url: POOL_KEYS[key] for key, urls in pools.items() for url in urls}


def check_admin(authorization: str | None, token: str | None, action: str = "change") -> None:
    """401/403 unless `authorization` is `Bearer <the admin token>`; `action` ("change" or
    "list") words the answer."""
    if not token:
        raise APIError(403, f"the worker set is fixed by the command line (start the router "
                       f"with ${ADMIN_TOKEN_ENV} set to {action} it)",
                       code="membership_fixed", error_type="permission_error")  # fmt: skip
    expected = f"Bearer {token}".encode()
    if authorization is None or not hmac.compare_digest(authorization.encode(), expected):
        raise APIError(401, f"to {action} the worker set, send the router's admin token",
                       code="invalid_admin_token", error_type="authentication_error")  # fmt: skip


def apply_membership(router: Router, roles: dict[str, str]) -> MembershipChange:
    """Make the router's worker set exactly `roles` (url -> role)."""
    workers = router.pool.workers
    left = [u for u, w in workers.items() if roles.get(u) != w.role]
    joined = [u for u, role in roles.items() if u not in workers or workers[u].role != role]
    for url in left:
        _leave(router, url)
    for url in joined:
        workers[url] = Worker(url, roles[url], WorkerPrefixIndex(1))  # polled at once (probe 0)
        if roles[url] != "prefill":
            router.ring.add(url)
    if joined or left:
        logger.info("membership: joined %s, left %s", joined or "-", left or "-")
    return MembershipChange(tuple(joined), tuple(left))


def _leave(router: Router, url: str) -> None:
    worker = router.pool.workers.pop(url)
    router.ring.remove(url)
    router.sessions.forget_worker(url)
    worker.is_healthy = False  # requests still streaming from it hold the object; none new go


def describe(router: Router) -> dict[str, Any]:
    return {
        "workers": [
            {"url": w.url, "role": w.role, "healthy": w.is_healthy, "open_requests": w.num_open}
            for w in router.pool.workers.values()
        ]
    }
