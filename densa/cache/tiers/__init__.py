"""KV beyond the device: tiers that keep full prefix pages as verified bytes (docs/kv-cache.md)."""
