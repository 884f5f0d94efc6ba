"""`densa bench kv-sweep`: KV formats swept over memory and concurrency (runner.py, report.py)."""
