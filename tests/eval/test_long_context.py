"""`densa eval long-context`: haystacks (fixed by the seed, under their length, the evidence at
its depth), scoring, and a run that pairs formats, shares each document through the prefix cache
and resumes from its log."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from densa.text.tokenizer import Tokenizer
from densa_bench.eval import long_context
from densa_bench.eval.formats import Format
from densa_bench.eval.long_context import SAMPLES, LongContextSettings, run_long_context
from densa_bench.eval.long_context_data import Item, build_haystack, load_sciq


@pytest.fixture(scope="module")
def count_tokens(smollm2_dir: Path) -> Callable[[str], int]:
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def test_a_haystack_is_fixed_by_its_seed_and_holds_its_evidence_in_order(
    count_tokens: Callable[[str], int],
) -> None:
    rows = load_sciq()
    one = build_haystack(rows, 4096, 0, 4, 3, count_tokens, seed=0)
    assert one == build_haystack(rows, 4096, 0, 4, 3, count_tokens, seed=0)
    assert one.document != build_haystack(rows, 4096, 1, 4, 3, count_tokens).document
    assert 3500 < count_tokens(one.document) < 4096 - 150
    keys = [i for i in one.items if i.kind == "passkey"]
    assert [i.depth for i in keys] == [0.125, 0.375, 0.625, 0.875]
    offsets = [one.document.index(f"is {i.answer}. Remember it.") for i in keys]
    assert offsets == sorted(offsets)  # deeper evidence sits later in the document
    assert offsets[0] / len(one.document) == pytest.approx(0.125, abs=0.05)
    questions = [i for i in one.items if i.kind == "qa"]
    assert len(questions) == 3 and all(i.answer in "ABCD" for i in questions)
    assert all(i.question.startswith("Using the passages above") for i in questions)


def test_answers_are_scored_by_their_first_number_or_letter() -> None:
    key = Item("passkey", "?", "48213", 0.5)
    assert key.is_correct("The pass key of the silver otter is 48213.")
    assert not key.is_correct("482130") and not key.is_correct("12345 or 48213")
    choice = Item("qa", "?", "B", 0.5)
    assert choice.is_correct("B) hybrid") and choice.is_correct("The answer is B.")
    assert not choice.is_correct("A) solid, not B")


def test_a_run_pairs_formats_shares_documents_and_resumes(
    tiny_formats: dict[str, Format], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = LongContextSettings(lengths=(1024,), haystacks=(2,), passkeys=2, questions=2,
                                   max_tokens=4)  # fmt: skip
    ref, bf16 = tiny_formats["ref"], tiny_formats["bf16"]
    report = run_long_context(ref, [bf16], settings, tmp_path)
    records = [json.loads(line)["record"] for line in (tmp_path / SAMPLES).read_text().splitlines()]
    haystacks = [r for r in records if "label" in r]
    assert sorted((r["label"], r["index"]) for r in haystacks) == [
        (label, i) for label in ("bf16", "ref") for i in (0, 1)
    ]
    for record in haystacks:  # the first item computes the document, the rest hit it
        assert all(c > record["prompt_tokens"] - 200 for c in record["cached_tokens"][1:])
    assert any("closed_book" in r for r in records)
    rows = {(e["label"], e.get("tokens")): e for e in report.summary if "label" in e}
    assert "all_delta" in rows[("bf16", 1024)] and "all_delta" not in rows[("ref", 1024)]

    def no_engine(*args: object) -> None:
        raise AssertionError("a resumed run with everything done loads no engine")

    monkeypatch.setattr(long_context, "_engine", no_engine)
    again = run_long_context(ref, [bf16], settings, tmp_path)
    assert again.summary == report.summary
