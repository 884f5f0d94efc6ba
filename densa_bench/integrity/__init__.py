"""`densa bench integrity`: the cost of KV integrity checks."""
