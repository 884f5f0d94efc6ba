"""`densa bench speculative`: speculative decoding on and off, densa vs llama-server.

runner.py  the run;  cli.py  its command;  report.py  its report
"""
