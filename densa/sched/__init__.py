"""L2: the scheduler (which tokens of which requests run this step) and the data it hands the worker."""
