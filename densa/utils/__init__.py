"""L0: small dependency-free helpers (sizes, ids, logging)."""
