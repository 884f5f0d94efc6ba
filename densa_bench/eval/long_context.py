"""`densa eval long-context`: retrieval and QA at 4k..32k tokens, per KV format, paired.

Per target length, a few haystacks (long_context_data.py): each one document with pass keys and
SciQ passages hidden at spread depths, and its questions asked after it. Every format answers
every item greedily; items pair across formats (same document, same question), so a format's
effect is the paired difference test - ref with a bootstrap interval over items.

What is shared, and why it is sound: within a format, a haystack's first question computes the
document and the others are admitted after it, hitting its pages in the prefix cache (they read
the document from the pages as stored, quantized or not, as a returning session would); the
documents, questions and the closed-book baseline (the SciQ questions without a document,
asked once, of the reference) are the same for every format. What is not shared: a document's
prefill in each KV format (its later chunks read earlier ones from that format's pages).

Engines load one at a time (a 1.5B per format) with the same exact page count, enough for the
longest document and its questions. Each haystack's answers are appended to <out>/samples.jsonl
as they finish, and a rerun with the same settings skips what is there: a multi-hour run that
stops loses one haystack, not the run.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from densa.engine.llm import LLM
from densa.sampling_params import SamplingParams
from densa.utils.logging import get_logger
from densa_bench.common.report import LinePlot, Series, Table
from densa_bench.eval.formats import Format
from densa_bench.eval.long_context_data import Haystack, build_haystack, load_sciq
from densa_bench.eval.report import QualityReport, new_report
from densa_bench.eval.stats import (
    DEFAULT_BOOTSTRAP,
    Bootstrap,
    Estimate,
    mean_ci,
    paired_difference_ci,
)

logger = get_logger(__name__)
SAMPLES = "samples.jsonl"


@dataclass(frozen=True)
class LongContextSettings:
    lengths: tuple[int, ...] = (4096, 8192, 16384, 32768)
    haystacks: tuple[int, ...] = (6, 4, 3, 2)  # per length: fewer where a prefill takes minutes
    passkeys: int = 8  # per haystack
    questions: int = 8  # SciQ questions per haystack
    max_tokens: int = 24
    seed: int = 0
    bootstrap: Bootstrap = DEFAULT_BOOTSTRAP

    def __post_init__(self) -> None:
        if len(self.haystacks) != len(self.lengths):
            raise ValueError("--haystacks needs one count per --lengths entry")
        if min(self.lengths) < 1024 or min(self.haystacks) < 1:
            raise ValueError("lengths must be >= 1024 tokens and haystack counts >= 1")
        if self.passkeys + self.questions < 1 or min(self.passkeys, self.questions) < 0:
            raise ValueError("need at least one pass key or question per haystack")

    @property
    def max_model_len(self) -> int:
        """Prompts stay under their target length with room for the answer (build_haystack)."""
        return max(self.lengths)

    def digest(self) -> str:
        """What a logged answer depends on: not the number of haystacks (haystack i of a
        length is the same document whatever the count), so a run can be extended."""
        fields = {k: v for k, v in asdict(self).items() if k not in ("bootstrap", "haystacks")}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def run_long_context(
    ref: Format, tests: list[Format], settings: LongContextSettings, out: Path
) -> QualityReport:
    """Length by length (shortest first), format by format: a run cut short still has every
    format at the lengths it finished."""
    formats = [ref, *tests]
    done = _load_done(out / SAMPLES, settings)
    haystacks: list[Haystack] | None = None
    for length in settings.lengths:
        for idx, fmt in enumerate(formats):
            missing = [i for i in range(_count(settings, length))
                       if (fmt.label, length, i) not in done]  # fmt: skip
            wants_book = idx == 0 and ("closed-book",) not in done
            if not missing and not wants_book:
                continue
            llm = _engine(fmt, settings)
            if haystacks is None:
                haystacks = _haystacks(llm, settings)
            by_key = {(h.length, h.index): h for h in haystacks}
            for index in missing:
                record = _answer_haystack(llm, fmt.label, by_key[(length, index)], settings)
                _append(out / SAMPLES, settings, record)
                done[(fmt.label, length, index)] = record
            if wants_book:
                book = _closed_book(llm, haystacks, settings)
                _append(out / SAMPLES, settings, {"closed_book": book})
                done[("closed-book",)] = book
            del llm
            gc.collect()
    return _report(formats, settings, done, done.get(("closed-book",), []))


def _count(settings: LongContextSettings, length: int) -> int:
    return settings.haystacks[settings.lengths.index(length)]


def _engine(fmt: Format, settings: LongContextSettings) -> LLM:
    """One format's engine: the same exact page count for every format (the longest document
    and its questions' own pages), the context to hold it, every question at once."""
    page_size = fmt.args.page_size
    per_question = 2 * (512 + settings.max_tokens) // page_size  # its tail page and its turn
    num_items = settings.passkeys + settings.questions
    pages = -(-settings.max_model_len // page_size) + num_items * per_question
    args = dataclasses.replace(
        fmt.args,
        max_model_len=settings.max_model_len,
        num_kv_pages=fmt.args.num_kv_pages or pages,
        max_num_seqs=max(num_items, 1),
        enable_prefix_caching=True,
    )
    logger.info("loading format %r", fmt.label)
    return LLM(**vars(args))


def _haystacks(llm: LLM, settings: LongContextSettings) -> list[Haystack]:
    rows = load_sciq()
    tokenizer = llm.tokenizer

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    return [
        build_haystack(rows, n, i, settings.passkeys, settings.questions, count, settings.seed)
        for n in settings.lengths
        for i in range(_count(settings, n))
    ]


def _answer_haystack(
    llm: LLM, label: str, haystack: Haystack, settings: LongContextSettings
) -> dict[str, Any]:
    """The first item computes the document; the rest are asked together after it."""
    prompts = [_chat(llm, haystack.prompt(item)) for item in haystack.items]
    longest = max(len(p) for p in prompts) + settings.max_tokens
    if longest > haystack.length:
        raise ValueError(f"a {haystack.length}-token haystack's prompt needs {longest} tokens")
    params = SamplingParams(temperature=0, max_tokens=settings.max_tokens)
    started = time.perf_counter()
    first = llm.generate(prompts[:1], params)
    first_s = time.perf_counter() - started
    rest = llm.generate(prompts[1:], [params] * (len(prompts) - 1)) if prompts[1:] else []
    results = [*first, *rest]
    correct = [i.is_correct(r.text) for i, r in zip(haystack.items, results, strict=True)]
    record: dict[str, Any] = {
        "label": label,
        "length": haystack.length,
        "index": haystack.index,
        "prompt_tokens": len(prompts[0]),
        "first_item_s": round(first_s, 2),
        "rest_s": round(time.perf_counter() - started - first_s, 2),
        "cached_tokens": [r.num_cached_tokens for r in results],
        "kinds": [item.kind for item in haystack.items],
        "depths": [item.depth for item in haystack.items],
        "answers": [item.answer for item in haystack.items],
        "outputs": [r.text for r in results],
        "correct": correct,
    }
    logger.info(
        "%s %d tokens #%d: %d/%d correct, document %.0f s", label, haystack.length,
        haystack.index, sum(correct), len(results), first_s,
    )  # fmt: skip
    return record


def _closed_book(llm: LLM, haystacks: list[Haystack], settings: LongContextSettings) -> list[bool]:
    """The SciQ questions without any document, in haystack order (knowledge, not retrieval)."""
    items = [item for h in haystacks for item in h.items if item.kind == "qa"]
    params = SamplingParams(temperature=0, max_tokens=settings.max_tokens)
    results = llm.generate([_chat(llm, item.closed_book) for item in items], params)
    return [item.is_correct(r.text) for item, r in zip(items, results, strict=True)]


def _chat(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


# ---- the resumable log -----------------------------------------------------------------------
def _load_done(path: Path, settings: LongContextSettings) -> dict[tuple[Any, ...], Any]:
    """Records of an earlier run with the same settings (keyed (label, length, index), and
    ("closed-book",)); a log of other settings is moved aside."""
    done: dict[tuple[Any, ...], Any] = {}
    if not path.exists():
        return done
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if any(line.get("settings") != settings.digest() for line in lines):
        path.rename(path.with_suffix(f".{int(time.time())}.old"))
        return done
    for line in lines:
        record = line["record"]
        if "closed_book" in record:
            done[("closed-book",)] = record["closed_book"]
        else:
            done[(record["label"], record["length"], record["index"])] = record
    return done


def _append(path: Path, settings: LongContextSettings, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(json.dumps({"settings": settings.digest(), "record": record}) + "\n")


# ---- the report ------------------------------------------------------------------------------
def _scores(records: Sequence[dict[str, Any]], kind: str | None) -> list[float]:
    """Per item 0/1, in (haystack, item) order, for one kind of item or all."""
    return [
        float(ok)
        for r in records
        for ok, k in zip(r["correct"], r["kinds"], strict=True)
        if kind is None or k == kind
    ]


def _report(
    formats: list[Format],
    settings: LongContextSettings,
    done: dict[tuple[Any, ...], Any],
    closed_book: list[bool],
) -> QualityReport:
    report = new_report("long-context", formats, asdict(settings))
    ref = formats[0].label
    rows, summary = [], []
    plot_points: dict[str, list[tuple[int, dict[str, float]]]] = {f.label: [] for f in formats}
    for length in settings.lengths:
        per_format = {
            f.label: [done[(f.label, length, i)] for i in range(_count(settings, length))]
            for f in formats
        }
        for fmt in formats:
            entry, row = _row(ref, fmt.label, length, per_format, settings.bootstrap)
            summary.append(entry)
            rows.append(row)
            plot_points[fmt.label].append((length, entry["all"]))
    report.summary = summary
    report.samples = [r for key, r in done.items() if len(key) == 3]
    columns = ["tokens", "format", "pass keys", "Δ", "SciQ in document", "Δ", "all", "Δ",
               "document prefill s"]  # fmt: skip
    title = "Accuracy, % (greedy; 95% CIs bootstrap over items; Δ paired with the reference)"
    report.tables.append(Table(title, columns, rows))
    if closed_book:
        book = mean_ci([float(x) for x in closed_book], settings.bootstrap)
        report.summary.append({"closed_book_qa": book.to_json(), "items": len(closed_book)})
        report.notes.append(
            f"Closed-book baseline: the same {len(closed_book)} SciQ questions with no document, "
            f"asked of {ref}: {book.format('.1f', 100)}% (what the model knows without "
            "retrieving; the in-document QA tests retrieval only above it)."
        )
    report.plots = [_plot(plot_points)]
    report.notes += [
        "Items within one haystack share its document, so they are not fully independent; "
        "the item bootstrap treats them as if they were, and the intervals are narrower than "
        "a haystack-level one would be. Pairing cancels most of it: both formats see the same "
        "document.",
        "Pass-key answers count when the first five-digit number in the output is the key; "
        "SciQ answers when the first standalone letter A-D is the right option.",
    ]
    return report


def _row(
    ref: str,
    label: str,
    length: int,
    per_format: dict[str, list[dict[str, Any]]],
    bootstrap: Bootstrap,
) -> tuple[dict[str, Any], list[str]]:
    entry: dict[str, Any] = {"tokens": length, "label": label}
    row = [str(length), label]
    for kind, key in (("passkey", "passkey"), ("qa", "qa"), (None, "all")):
        mine = _scores(per_format[label], kind)
        estimate: Estimate = mean_ci(mine, bootstrap)
        entry[key] = estimate.to_json()
        row.append(estimate.format(".1f", 100))
        if label == ref:
            row.append("")
            continue
        delta = paired_difference_ci(_scores(per_format[ref], kind), mine, bootstrap)
        entry[f"{key}_delta"] = delta.to_json()
        ref_estimate = mean_ci(_scores(per_format[ref], kind), bootstrap)
        entry[f"{key}_within_ref_ci"] = ref_estimate.low <= estimate.value <= ref_estimate.high
        row.append(delta.format(".1f", 100))
    seconds = [r["first_item_s"] for r in per_format[label]]
    entry["document_prefill_s"] = seconds
    row.append(f"{sum(seconds) / len(seconds):.0f}")
    return entry, row


def _plot(points: dict[str, list[tuple[int, dict[str, float]]]]) -> LinePlot:
    series = [
        Series(
            label,
            [float(n) for n, _ in values],
            [100 * e["value"] for _, e in values],
            [100 * e["low"] for _, e in values],
            [100 * e["high"] for _, e in values],
        )
        for label, values in points.items()
    ]
    return LinePlot(
        "accuracy_vs_length", "Pass keys + SciQ in the document, accuracy vs length",
        "prompt tokens", "accuracy % (95% CI)", series, log_x=True,
    )  # fmt: skip
