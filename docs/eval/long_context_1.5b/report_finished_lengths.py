"""The long-context report over the lengths a cut-short run finished (4k, 8k, 16k)."""
import dataclasses
from pathlib import Path
from densa.setup.args import EngineArgs
from densa_bench.eval.formats import parse_format
from densa_bench.eval import long_context as lc

out = Path("docs/eval/long_context_1.5b")
full = lc.LongContextSettings(lengths=(4096, 8192, 16384, 32768), haystacks=(3, 2, 1, 1))
done = lc._load_done(out / lc.SAMPLES, full)
base = EngineArgs(model="qwen2.5-coder-1.5b", kv_cache_memory="auto")
specs = ["bf16-kv:kv_cache_dtype=bfloat16", "int8-kv:kv_cache_dtype=int8", "fp8-kv:kv_cache_dtype=fp8_e4m3"]
formats = [parse_format(s, base) for s in specs]
finished = dataclasses.replace(full, lengths=(4096, 8192, 16384), haystacks=(3, 2, 1))
report = lc._report(formats, finished, done, done.get(("closed-book",), []))
paths = report.write(out)
for t in report.tables[1:]:
    print(t.to_markdown() + "\n")
print(paths)
