"""`densa bench serving`: densa vs transformers at fixed concurrency levels.

runner.py  settings and the run;  report.py  its summary, tables and plots;
hf_baseline.py  the transformers peer
"""
