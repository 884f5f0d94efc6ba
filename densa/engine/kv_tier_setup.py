"""Which KV tiers an engine uses, and under which keys (`--kv-tier`, docs/kv-cache.md): every
tier is keyed, with the cluster's tier key where there is a cluster secret, else with a key of
its own (the disk tier's directory key, the host tier's process key); the shared tier needs the
secret. The shared store's password comes from a file or the environment, never an option's
value. engine/kv_tiers.py drives the tiers built here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from densa.auth.secret import load_secret
from densa.cache.tiers.block import fingerprint_of
from densa.cache.tiers.disk import DiskTier
from densa.cache.tiers.host import HostTier
from densa.cache.tiers.shared import SharedTier
from densa.cache.tiers.tier import KVTier, TierSpec, logger, parse_tier_spec
from densa.model.arch import ArchConfig
from densa.sched.output import PackedPages

TIER_KEY_PURPOSE = "kv-tier"  # ClusterSecret.key(...): every tier's MAC where there is a secret
STORE_PASSWORD_ENV = "DENSA_KV_TIER_PASSWORD"  # the shared store's password, else in a file


def build_tiers(specs: Sequence[str], fingerprint: bytes, secret_file: str | None,
                password_file: str | None = None) -> list[KVTier]:  # fmt: skip
    """The tiers `--kv-tier` names, in the order given. Every tier is keyed: with the cluster
    secret under its tier key; without, each under a key of its own (block.py)."""
    parsed = [parse_tier_spec(spec) for spec in specs]
    secret = load_secret(secret_file)
    cluster_key = secret.key(TIER_KEY_PURPOSE) if secret is not None else None
    tiers: list[KVTier] = []
    try:
        for spec in parsed:
            tiers.append(_build_one(spec, fingerprint, cluster_key, password_file))
    except Exception:  # a tier refused: close the ones already open
        for tier in tiers:
            tier.close()
        raise
    return tiers


def _build_one(spec: TierSpec, fingerprint: bytes, cluster_key: bytes | None,
               password_file: str | None) -> KVTier:  # fmt: skip
    if spec.kind == "disk":
        return DiskTier(spec.path, spec.size_bytes, fingerprint, cluster_key)
    if spec.kind == "host":
        return HostTier(spec.size_bytes, fingerprint, cluster_key)
    if cluster_key is None:
        raise ValueError(
            "--kv-tier shared:... needs the cluster secret (--cluster-secret-file or "
            "DENSA_CLUSTER_SECRET): every value in the shared store is sealed with it"
        )
    assert spec.store is not None
    if spec.store.password:
        logger.warning("--kv-tier shared:%s: the store's password is in the URL, where `ps` shows "
                       "it to every user of this host (the engine process gets its options "
                       "through a pipe, but the command you typed keeps them): give it with "
                       "--kv-tier-password-file FILE or %s instead", spec.store.location,
                       STORE_PASSWORD_ENV)  # fmt: skip
    address = spec.store.with_password(store_password(password_file))
    return SharedTier(address, fingerprint, cluster_key)


def store_password(password_file: str | None) -> str:
    """The shared store's password: the text of `password_file` (surrounding whitespace
    dropped), else DENSA_KV_TIER_PASSWORD, else none. Never an option's value: `ps` shows
    those."""
    if password_file:
        try:
            return Path(password_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"--kv-tier-password-file {password_file}: cannot read it "
                             f"({exc.strerror or type(exc).__name__})") from None  # fmt: skip
    return os.environ.get(STORE_PASSWORD_ENV, "").strip()


def engine_fingerprint(model_path: str, weight_format: str, kv_format: str, page: PackedPages,
                       arch: ArchConfig, key_encoding: str) -> bytes:  # fmt: skip
    """What must match for a stored page to be this engine's: the model file (by name and
    size, so two machines with the same file agree), its weight format, the KV format with its
    static scales and how it holds K (centered or not), the page geometry and architecture."""
    path = Path(model_path)
    size = path.stat().st_size if path.is_file() else 0
    architecture = repr(sorted(arch.signature().items()))
    return fingerprint_of(path.name, str(size), weight_format, kv_format, page.kv_dtype,
                          page.kv_scales, repr(page.static_scales), repr(page.shape[:2]),
                          repr(page.shape[3:]), architecture, key_encoding)  # fmt: skip
