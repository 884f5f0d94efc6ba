"""The GPU machine check and its report.

check.py   the check (`python -m densa_bench.gpu.check`);  report.py  tables and plots
           (`python -m densa_bench.gpu.report`);  kernels.py, model.py, e2e.py  its parts
"""
