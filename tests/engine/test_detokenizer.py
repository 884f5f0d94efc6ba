"""Incremental detokenization equals decoding everything at once; stop strings cut exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from densa.text.detokenizer import Detokenizer
from densa.text.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! This is a test of incremental decoding.",
    "Unicode: héllo wörld — 你好，世界 🙂🚀 done",
    "  leading spaces and\nnewlines\n\n  indented code():\n\treturn 1",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


def stream(
    tokenizer: Tokenizer, text: str, stop: tuple[str, ...] = (), include: bool = False
) -> tuple[list[str], Detokenizer]:
    prompt = tokenizer.encode("Prompt:")
    detok = Detokenizer(tokenizer, prompt, stop, include, skip_special_tokens=True)
    deltas = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        detok.add_token(token)
        if detok.check_stop():
            break
        deltas.append(detok.take_delta(finished=False))
    deltas.append(detok.take_delta(finished=True))
    return deltas, detok


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer: Tokenizer, text: str) -> None:
    deltas, detok = stream(tokenizer, text)
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)  # never a half character


def test_stop_string_cuts_the_text_and_is_never_streamed(tokenizer: Tokenizer) -> None:
    deltas, detok = stream(tokenizer, "The answer is 42. END of story", stop=("END",))
    assert "".join(deltas) == "The answer is 42. "
    assert detok.stopped
    assert not any("E" in d for d in deltas)  # the prefix of the stop string was held back


def test_stop_string_kept_when_asked(tokenizer: Tokenizer) -> None:
    deltas, detok = stream(tokenizer, "one two three four", stop=("four", "three"), include=True)
    assert "".join(deltas) == "one two three"
    assert detok.stop_string == "three"  # the one found first in the text, not in the list


def test_text_that_only_starts_like_a_stop_string_is_released(tokenizer: Tokenizer) -> None:
    deltas, detok = stream(tokenizer, "an ENDLESS ENvelope", stop=("ENDX",))
    assert not detok.stopped and detok.stop_string is None
    assert "".join(deltas) == "an ENDLESS ENvelope"


class _CharTokenizer:
    """Token id = a character's code point."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids)


def _stream(stop: tuple[str, ...], text: str) -> list[str]:
    from densa.text.detokenizer import Detokenizer

    detok = Detokenizer(_CharTokenizer(), [], stop, False, True)  # type: ignore[arg-type]
    deltas = []
    for char in text:
        detok.add_token(ord(char))
        detok.check_stop()
        deltas.append(detok.take_delta(False))
    return deltas


def test_hold_back_only_text_that_could_still_start_a_stop_string() -> None:
    long_stop = "x" * 3000
    deltas = _stream((long_stop, "STOP"), "hello ST world")
    # Nothing waits for the 3000-character stop string; "ST" waits until it cannot be "STOP".
    assert deltas[:6] == ["h", "e", "l", "l", "o", " "]
    assert deltas[6:8] == ["", ""]
    assert deltas[8] == "ST "
    assert "".join(deltas) == "hello ST world"


def test_overlapping_stop_prefixes_are_held_exactly() -> None:
    assert _stream(("abc",), "aababx") == ["", "a", "", "ab", "", "abx"]
