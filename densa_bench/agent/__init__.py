"""`densa bench agent`: coding-agent sessions replayed against densa and llama-server."""
