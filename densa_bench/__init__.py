"""densa's measurement: benchmarks (`densa bench ...`) and quality evaluations (`densa eval ...`).

A package beside densa that uses only densa's public face (densa.LLM and the engine's public
methods, the servers' HTTP API, EngineStats, step observers); densa imports it only in the lazy
entry points of densa/cli.py. Results go out as JSON + Markdown + PNG plots (common/report.py).

common/       what benchmarks and evaluations share: stats, hardware, reports and plots, offline
              data, per-request timing, local worker and Redis processes, an OpenAI load client
cli.py        `add_bench_parser`: the `densa bench ...` sub-commands
<benchmark>/  one subpackage per benchmark: runner.py (settings, run), report.py where the report
              is its own module: serving, load, prefix, disagg, router, integrity, kv_sweep,
              weights, moe, structured, tiers, speculative, peers, hostile, step_bytes,
              gpu (the GPU machine check), attention (CPU paged-attention micro-benchmark),
              dsa (sparse attention vs dense MLA decode by context length)
eval/         quality evaluations (`add_eval_parser`: the `densa eval ...` sub-commands)
"""
