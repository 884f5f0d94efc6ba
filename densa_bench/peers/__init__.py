"""`densa bench peers`: densa vs other servers (llama-server, ...) on one machine.

runner.py  waves and results;  servers.py  peer server processes;  specs.py  how each peer starts;
cli.py     the command;  report.py  tables and plots
"""
