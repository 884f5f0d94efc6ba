"""Compare xgrammar and llguidance on densa's 22 test schemas with SmolLM2's 49152-token vocabulary:
compile time per schema (cold, no cache) and the cost of one token bitmask.

The token sequences are the same for both engines: a seeded random walk through llguidance's
masks (random allowed token each step, up to 48 tokens), replayed through xgrammar.

xgrammar is not a densa dependency; install it beside the venv to run this:
    pip install --no-deps --target /tmp/xgr xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
    PYTHONPATH=/tmp/xgr:. .venv/bin/python scripts/compare_grammar_engines.py
"""

from __future__ import annotations

import json
import random
import statistics
import time

import numpy as np
import torch

from densa.model.loader import resolve_model_dir
from densa.setup.args import default_model_path
from densa_bench.structured.schemas import SCHEMA_CASES

STEPS = 48


def main() -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(resolve_model_dir(default_model_path())))
    vocab = len(hf)
    walks, ll = run_llguidance(hf, vocab)
    xg = run_xgrammar(hf, vocab, walks)
    print(json.dumps({"vocab": vocab, "llguidance": ll, "xgrammar": xg}, indent=1))


def run_llguidance(hf, vocab):
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    tokenizer_s = time.perf_counter() - t0
    compile_ms, mask_us, walks = [], [], []
    rng = random.Random(0)
    opts = {"whitespace_flexible": False}
    for case in SCHEMA_CASES:
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(case.schema, defaults=opts)
        m = llguidance.LLMatcher(tok, grammar)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        assert not m.is_error(), m.get_error()
        mask = lln.allocate_token_bitmask(1, vocab)
        walk = []
        for _ in range(STEPS):
            t0 = time.perf_counter()
            lln.fill_next_token_bitmask(m, mask, 0)
            mask_us.append((time.perf_counter() - t0) * 1e6)
            bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab]
            allowed = np.flatnonzero(bits)
            allowed = [t for t in allowed.tolist() if t != tok.eos_token] or allowed.tolist()
            token = rng.choice(allowed)
            if m.is_stopped():
                break
            assert m.consume_token(token), m.get_error()
            walk.append(token)
        walks.append(walk)
    return walks, _summary(tokenizer_s, compile_ms, mask_us)


def run_xgrammar(hf, vocab, walks):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    tokenizer_s = time.perf_counter() - t0
    compile_ms, mask_us = [], []
    for case, walk in zip(SCHEMA_CASES, walks, strict=True):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(case.schema), any_whitespace=False)
        matcher = xgr.GrammarMatcher(compiled)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        mask = xgr.allocate_token_bitmask(1, vocab)
        for token in walk:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            mask_us.append((time.perf_counter() - t0) * 1e6)
            if not matcher.accept_token(token):
                break  # the engines disagree on this token; stop timing this walk
    return _summary(tokenizer_s, compile_ms, mask_us)


def _summary(tokenizer_s, compile_ms, mask_us):
    return {
        "tokenizer_setup_s": round(tokenizer_s, 3),
        "compile_ms_median": round(statistics.median(compile_ms), 2),
        "compile_ms_max": round(max(compile_ms), 2),
        "compile_ms_total": round(sum(compile_ms), 1),
        "mask_us_median": round(statistics.median(mask_us), 1),
        "mask_us_p95": round(float(np.percentile(mask_us, 95)), 1),
        "num_masks": len(mask_us),
    }


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
