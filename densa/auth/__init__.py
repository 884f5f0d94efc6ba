"""The internal plane's credentials (docs/security.md): the cluster secret and what is derived
from it. Torch-free and dependency-free (hmac, hashlib, secrets), so the router, the fronts, the
engine and the cluster supervisor share one implementation.

    secret.py      ClusterSecret: loaded from a file or the environment, never from argv;
                   one key per purpose, derived with HMAC-SHA256
    placement.py   the router's signed placement token (x-densa-placement): which prefill
                   worker a decode worker may reach for one request, until when
    frames.py      per-message authentication of the KV link (HMAC-SHA256 over every frame,
                   under a session key both ends derive at the handshake)
"""
