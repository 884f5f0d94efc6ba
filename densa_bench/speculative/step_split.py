"""Where a speculative decode step's time goes, in-process (issue 26).

    python -m densa_bench.speculative.step_split --model qwen2.5-coder-1.5b -k 8 \
        [--draft qwen2.5-coder-0.5b] [--threads 1]

One engine (int8 KV, greedy, fused C++ decode) runs the same code-edit request with and without
speculation (`SamplingParams(speculative=False)`), A/B/A/B, and times every stage of each decode
step: scheduling, the proposer, building the inputs, the forward (C++ decode of M rows), the
head (lm_head of the sampled rows), sampling/acceptance, and the rest of the step (output
bookkeeping). Then it times the forward of M = 1..8 decode rows directly, interleaved, best of
several. A shared machine drifts: read the ratios (same process, back to back), not the
absolute times.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from densa.engine.llm import LLM
from densa.model.fused_decode import FusedDecoder
from densa.sampling_params import SamplingParams

STAGES = ("schedule", "propose", "inputs", "forward", "head", "sample", "rest")
SOURCE = Path(__file__).resolve().parents[2] / "densa" / "engine" / "llm_engine.py"
ASK = (
    "Return the file above unchanged except for one new first line, the comment "
    "`# reviewed`. Write the whole file, nothing else."
)


class StageClock:
    """Seconds per stage of the current step (wrapped callables add to it)."""

    def __init__(self) -> None:
        self.now: dict[str, float] = defaultdict(float)
        self.rows = 0  # rows the step's forward computed
        self.inside: str | None = None  # the stage running now: a draft's forwards are its own

    def wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.inside is not None:  # nested (the draft proposer's forward): not counted
                return fn(*args, **kwargs)
            started = time.perf_counter()
            self.inside = stage
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside = None
                self.now[stage] += time.perf_counter() - started

        return timed

    def take(self) -> dict[str, float]:
        out, self.now = dict(self.now), defaultdict(float)
        out["rows"], self.rows = float(self.rows), 0
        return out


def instrument(llm: LLM, clock: StageClock) -> None:
    """Time each stage by wrapping the callable that does it (instance attributes shadow the
    methods; the fused decoder is patched on its class: it is built on the first decode step)."""
    engine = llm.engine
    runner = engine.runner

    def timed(owner: object, name: str, stage: str) -> None:
        setattr(owner, name, clock.wrap(stage, getattr(owner, name)))

    timed(engine.scheduler, "schedule", "schedule")
    if engine.speculator is not None:
        timed(engine.speculator.proposer, "propose", "propose")
    prepare = clock.wrap("inputs", runner.prepare_inputs)

    def counted(items: Any) -> Any:
        inputs = prepare(items)
        clock.rows += int(inputs.input_ids.numel())
        return inputs

    runner.prepare_inputs = counted  # type: ignore[method-assign,assignment]
    timed(FusedDecoder, "forward", "forward")
    for model in {id(m): m for m in (runner.model, runner.decode_model) if m}.values():
        timed(model, "compute_logits", "head")
    timed(runner.sampler, "sample", "sample")


def code_edit_prompt(llm: LLM, prompt_len: int) -> list[int]:
    lines = SOURCE.read_text().splitlines()[60:]
    kept: list[str] = []
    for line in lines:
        if len(llm.tokenizer.encode("\n".join(kept))) >= prompt_len:
            break
        kept.append(line)
    text = "```python\n" + "\n".join(kept) + "\n```\n\n" + ASK
    return list(llm.tokenizer.encode_chat([{"role": "user", "content": text}]))


def run_request(
    llm: LLM, clock: StageClock, prompt: list[int], max_tokens: int, speculative: bool
) -> tuple[list[int], list[dict[str, float]], list[int]]:
    """Greedy tokens, and per decode step its stage times and tokens emitted."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, speculative=speculative)
    rid = engine.add_request(prompt, params)
    tokens: list[int] = []
    steps: list[dict[str, float]] = []
    emitted: list[int] = []
    clock.take()
    while True:
        started = time.perf_counter()
        deltas = engine.step()
        total = time.perf_counter() - started
        stages = clock.take()
        new = [t for d in deltas if d.request_id == rid for t in d.new_token_ids]
        finished = any(d.finished for d in deltas if d.request_id == rid)
        if tokens and new:  # a decode step (the first emits the prefill's token)
            stages["rest"] = total - sum(v for k, v in stages.items() if k != "rows")
            stages["total"] = total
            steps.append(stages)
            emitted.append(len(new))
        tokens.extend(new)
        if finished:
            return tokens, steps, emitted


def summarize(name: str, steps: list[dict[str, float]], emitted: list[int]) -> dict[str, float]:
    med = {s: statistics.median(st.get(s, 0.0) for st in steps) * 1e3 for s in (*STAGES, "total")}
    tps = sum(emitted) / len(emitted)
    rows = sum(st["rows"] for st in steps) / len(steps)
    # Decode time per token, as a client sees it between tokens (the benchmark's TPOT).
    med["tpot"] = sum(st["total"] for st in steps) / sum(emitted) * 1e3
    parts = "  ".join(f"{s} {med[s]:.2f}" for s in STAGES)
    print(
        f"{name:>6}: {len(steps)} steps, {rows:.2f} rows and {tps:.2f} tokens per step, "
        f"TPOT {med['tpot']:.1f} ms, median step {med['total']:.1f} ms: {parts}"
    )
    med["tokens_per_step"] = tps
    return med


def forward_rows(llm: LLM, rows: list[int], repeats: int, context: int) -> dict[int, float]:
    """min over repeats of one fused forward of M decode rows (one sequence, positions
    context..context+M-1), M interleaved."""
    runner = llm.engine.runner
    decoder = runner.fused_decoder()
    assert decoder is not None, "the model has no fused decode step, or it is off"
    page_size = runner.page_size
    pages = torch.arange(1, 1 + (context + max(rows)) // page_size + 1, dtype=torch.int32)
    best: dict[int, float] = {m: float("inf") for m in rows}
    for _ in range(repeats):
        for m in rows:
            positions = torch.arange(context, context + m)
            ids = torch.full((m,), 100, dtype=torch.long)
            table = pages.expand(m, -1).contiguous()
            seq_lens = (positions + 1).to(torch.int32)
            slot_pages = pages[positions // page_size].long()
            meta = _Meta(table, seq_lens, slot_pages, positions % page_size)
            started = time.perf_counter()
            hidden = decoder.forward(ids, positions, meta)  # type: ignore[arg-type]
            runner.model.compute_logits(hidden)
            best[m] = min(best[m], time.perf_counter() - started)
    return best


class _Group:
    def __init__(self, table: torch.Tensor, seq_lens: torch.Tensor) -> None:
        self.page_table, self.seq_lens = table, seq_lens


class _Meta:
    prefill = None

    def __init__(
        self,
        table: torch.Tensor,
        seq_lens: torch.Tensor,
        slot_pages: torch.Tensor,
        slot_offsets: torch.Tensor,
    ) -> None:
        self.decode = _Group(table, seq_lens)
        self.slot_pages, self.slot_offsets = slot_pages, slot_offsets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default=None, help="a draft model (else prompt lookup)")
    ap.add_argument("-k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2, help="A/B rounds")
    ap.add_argument(
        "--rows",
        type=int,
        nargs="*",
        default=[1, 2, 3, 5, 7, 9],
        help="time the forward + head of these numbers of rows",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as configured)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec: dict[str, Any] = (
        {"speculative_model": args.draft} if args.draft else {"speculative_method": "ngram"}
    )
    llm = LLM(
        args.model, kv_cache_dtype="int8", max_model_len=512, max_num_seqs=4,
        num_speculative_tokens=args.k, enable_prefix_caching=False, **spec,
    )  # fmt: skip
    clock = StageClock()
    instrument(llm, clock)
    prompt = code_edit_prompt(llm, args.prompt_len)
    cost = llm.engine.speculator.proposer.cost_per_token if llm.engine.speculator else 0.0
    print(
        f"prompt {len(prompt)} tokens, output {args.output_len}, k={args.k}, {spec}, "
        f"proposer cost per token {cost:.3f}"
    )
    run_request(llm, clock, prompt, 4, True)  # warm-up
    runs: dict[str, list[dict[str, float]]] = {"off": [], "spec": []}
    outputs: set[tuple[int, ...]] = set()
    for _ in range(args.rounds):
        for name, on in (("off", False), ("spec", True)):
            tokens, steps, emitted = run_request(llm, clock, prompt, args.output_len, on)
            runs[name].append(summarize(name, steps, emitted))
            outputs.add(tuple(tokens))
    assert len(outputs) == 1, "greedy outputs differ with and without speculation"
    off_step = min(r["total"] for r in runs["off"])
    spec_step = min(r["total"] for r in runs["spec"])
    tps = runs["spec"][0]["tokens_per_step"]
    tpot = {name: min(r["tpot"] for r in rs) for name, rs in runs.items()}
    print(
        f"spec step / plain step = {spec_step / off_step:.2f} (medians, best run); {tps:.2f} "
        f"tokens per step; TPOT off / spec = {tpot['off'] / tpot['spec']:.2f} (best runs)"
    )
    if args.rows:
        best = forward_rows(llm, args.rows, 5, len(prompt))
        base = best[min(best)]
        print("forward + head of M rows (min of 5), ms and x the fewest: " + "  ".join(
            f"M={m} {best[m] * 1e3:.1f} ({best[m] / base:.2f}x)" for m in args.rows))  # fmt: skip


if __name__ == "__main__":
    main()
