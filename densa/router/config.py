"""The router's settings, validated once and frozen (flags: densa/router/cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from densa.auth.secret import ClusterSecret
from densa.openai.prepare import DEFAULT_MAX_BODY_BYTES
from densa.router.lengths import DEFAULT_EXPECTED_TOKENS
from densa.router.membership import check_pools
from densa.router.policy import POLICIES, Weights
from densa.router.ring import DEFAULT_VNODES
from densa.router.sessions import DEFAULT_TTL_S
from densa.router.workers import HealthOptions


@dataclass(frozen=True)
class RouterConfig:
    workers: tuple[str, ...] = ()  # co-located workers: each runs prefill and decode
    prefill: tuple[str, ...] = ()  # prefill pool (P/D mode)
    decode: tuple[str, ...] = ()  # decode pool (P/D mode): responses come from these
    policy: str = "densa"  # policy.POLICIES
    weights: Weights = field(default_factory=Weights)
    session_ttl_s: float = DEFAULT_TTL_S
    ring_vnodes: int = DEFAULT_VNODES
    health: HealthOptions = field(default_factory=HealthOptions)
    max_attempts: int = 3  # workers one request may be tried on (before any byte is sent)
    upstream_timeout_s: float = 600.0  # no byte from a worker for this long: the attempt fails
    connect_timeout_s: float = 2.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_expected_tokens: int = DEFAULT_EXPECTED_TOKENS  # before any request has finished
    # Lets PUT /densa/workers replace the worker set (router/membership.py); None: fixed by flags.
    admin_token: str | None = field(default=None, repr=False)
    # Signs each placement on a prefill + decode pair (densa/auth/placement.py); decode workers
    # refuse an x-densa-prefill without it, so prefill and decode pools need one.
    secret: ClusterSecret | None = field(default=None, repr=False)
    # x-densa-worker, x-densa-prefill and x-densa-router-ms on answers: off by default, since
    # they tell any client the internal addresses and a timer of the router's own work.
    debug_headers: bool = False
    # Every worker reads one shared KV tier (--kv-tier shared:...), whatever it reports: a
    # prefix routed to any worker counts, at SHARED_TIER_CREDIT, as fetchable by all
    # (router/policy.py). Off, the router learns each worker's store from its load reports.
    shared_kv_tier: bool = False

    def __post_init__(self) -> None:
        if not self.workers and not self.decode:
            raise ValueError("give at least one --worker URL (or --prefill and --decode URLs)")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("--prefill and --decode come together: give both pools or neither")
        check_pools(list(self.workers), list(self.prefill), list(self.decode),
                    has_secret=self.secret is not None)  # fmt: skip
        if self.policy not in POLICIES:
            raise ValueError(f"unknown --policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if self.max_attempts < 1:
            raise ValueError("--max-attempts must be at least 1")
        if self.session_ttl_s <= 0:
            raise ValueError("--session-ttl must be a positive number of seconds")

    def roles(self) -> dict[str, str]:
        """url -> role, in command-line order."""
        return {
            **{u: "mixed" for u in self.workers},
            **{u: "prefill" for u in self.prefill},
            **{u: "decode" for u in self.decode},
        }
