"""`densa bench prefix`: prefix caching on shared-prefix workloads."""
