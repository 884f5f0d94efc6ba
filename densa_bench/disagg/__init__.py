"""`densa bench disagg`: prefill/decode disaggregation vs co-location (runner.py, report.py)."""
