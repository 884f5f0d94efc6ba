"""The GPU machine check and its report.

check.py   the check (`python -m densa_bench.gpu.check`);  report.py  tables and plots
           (`python -m densa_bench.gpu.report`);  its parts: kernels.py (each Triton kernel
           against its reference, timed), timing.py (sizes, results, roofline timing),
           model.py, e2e.py (end to end)
"""
