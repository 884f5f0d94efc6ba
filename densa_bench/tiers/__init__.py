"""`densa bench tiers`: KV tiers (host, disk, shared) restoring evicted prefixes."""
