"""Quality evaluation (`densa eval ...`): does a numeric format change what the model says?

Each evaluation compares test formats (EngineArgs overrides) with a reference format, every
format's engine loaded in one process, and reports 95% bootstrap confidence intervals. Data (ARC,
HellaSwag, MMLU) comes from densa_bench.common.data, LAMBADA text from densa.quant.calibration_data,
and reports are written by densa_bench.common.report, shared with the benchmarks.

formats.py          `[label:]key=value,...` specs -> EngineArgs per format
stats.py            block / paired bootstrap intervals; KL, top-1 agreement, NLL per position
distribution.py     `densa eval distribution`: KL, top-1 agreement, perplexity on English text
prefix_scoring.py   log-likelihoods of several continuations sharing one context's KV pages
choice.py           `densa eval choice`: multiple-choice accuracy, paired deltas
greedy.py           `densa eval greedy`: token-identical greedy generations, first divergence
common.py           one engine per format;  report.py   QualityReport, interval plots
cli.py              `add_eval_parser`: the `densa eval ...` sub-commands
"""
