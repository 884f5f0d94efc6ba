"""L2: the scheduler (which tokens of which requests run each step) and what it hands the worker."""
