"""The router's piece-caching tokenizer gives exactly the ids a worker's full encode gives."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from densa.ipc.messages import TokenizerFiles
from densa.router.tokens import PieceCachingTokenizer
from densa.text.tokenizer import Tokenizer, read_tokenizer_files

WORDS = ["hello", " world", "\n", "  ", "ünïcödé", "日本語", "<|im_end", "|>", "<|im_start|>",
         "im_end", "\t", "42", "rocket", "'s", "🙂", " ", ".", "<|endoftext|>", "\n\n"]  # fmt: skip


@pytest.fixture(scope="module")
def files(smollm2_dir: Path) -> TokenizerFiles:
    return read_tokenizer_files(smollm2_dir)


def test_chats_encode_to_the_same_ids_as_the_full_encode(files: TokenizerFiles) -> None:
    full, tokenizer = Tokenizer(files), PieceCachingTokenizer(files, max_pieces=64)
    cached = tokenizer.scoped("tenant-a")
    assert cached.verbatim_added_tokens is not None  # SmolLM2's added tokens are all verbatim
    rng = random.Random(0)
    system = "You are a helpful assistant. " * 30
    for _ in range(200):
        messages = [{"role": "system", "content": system}]
        for turn in range(rng.randint(1, 4)):
            text = "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 12)))
            messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": text})
        expected = full.encode_chat(messages)
        assert cached.encode_chat(messages) == expected
        assert cached.encode_chat(messages) == expected  # from the cache this time
    assert 0 < len(tokenizer._pieces) <= 64  # one cache, shared by the views


def test_text_with_special_tokens_and_plain_encodes_agree(files: TokenizerFiles) -> None:
    full, tokenizer = Tokenizer(files), PieceCachingTokenizer(files)
    rng = random.Random(1)
    for _ in range(300):
        text = "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 20)))
        for cached in (tokenizer, tokenizer.scoped("a"), tokenizer.scoped("b")):
            assert cached.encode(text, False) == full.encode(text, False)
            assert cached.encode(text) == full.encode(text)
    assert {scope for scope, _ in tokenizer._pieces} == {"a", "b"}  # unscoped: never cached


def test_a_piece_is_cached_per_scope(files: TokenizerFiles) -> None:
    tokenizer = PieceCachingTokenizer(files)
    a, b = tokenizer.scoped("a"), tokenizer.scoped("b")
    a.encode("<|im_start|>shared text<|im_end|>", False)
    assert list(tokenizer._pieces) == [("a", "shared text")]
    b.encode("<|im_start|>shared text<|im_end|>", False)
    assert list(tokenizer._pieces) == [("a", "shared text"), ("b", "shared text")]
