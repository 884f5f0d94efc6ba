"""`densa bench load`: an HTTP server under open-loop load (runner.py), its report (report.py)."""
