"""Tokenizing prompts fast enough for a router: the workers' tokenizer, with a cache of pieces.

A multi-turn chat re-sends its whole history every turn, and a tenant's sessions share one long
system prompt, so nearly all of a prompt's text has been tokenized before. When the tokenizer
matches its added tokens verbatim (`Tokenizer.verbatim_added_tokens`: ChatML's <|im_start|> and
<|im_end|>, for instance), text between them encodes independently of its neighbours, so the
router encodes each piece once and reuses its ids:

    <|im_start|> "system\\nYou are ..." <|im_end|> "\\n" <|im_start|> "user\\nHi" <|im_end|> ...
                 ^ cached after the first request of the tenant          ^ new: encoded now

The ids are the ones a full encode gives (tests/router/test_tokens.py checks it on many chats);
a tokenizer whose added tokens are not verbatim is encoded whole, as the workers do.

The cache is keyed by cache scope as well as text: a hit is faster than a miss (a 32 KiB system
prompt: ~10x), so a cache shared across tenants would let tenant A time whether tenant B sent a
given text. Only `scoped(scope)` views cache; the unscoped tokenizer encodes every piece.
"""

from __future__ import annotations

import copy
import re
from collections import OrderedDict

from densa.ipc.messages import TokenizerFiles
from densa.text.tokenizer import Tokenizer

DEFAULT_MAX_PIECES = 8192


class PieceCachingTokenizer(Tokenizer):
    """A Tokenizer whose scoped views' `encode(text, add_special_tokens=False)` -- what chat
    prompts use -- reuse the ids of text pieces seen before in the same cache scope. Mutates
    only its own cache (shared by its views)."""

    def __init__(
        self,
        files: TokenizerFiles,
        eos_token_ids: tuple[int, ...] = (),
        max_pieces: int = DEFAULT_MAX_PIECES,
    ) -> None:
        super().__init__(files, eos_token_ids)
        self.max_pieces = max_pieces
        # (cache scope, piece) -> ids, least recently used first; one LRU for every scope
        self._pieces: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self._scope: str | None = None  # a view's scope; None: no caching
        added = self.verbatim_added_tokens
        self._added = added or {}
        longest_first = sorted(self._added, key=len, reverse=True)
        self._splitter = (
            re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if added else None
        )

    def scoped(self, scope: str) -> PieceCachingTokenizer:
        """A view that caches pieces under `scope` (a cache-scope digest) and shares everything
        else, the cache included, with this tokenizer."""
        _ = self.max_token_bytes  # computed once here, not once per view (it walks the vocab)
        view = copy.copy(self)
        view._scope = scope
        return view

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if add_special_tokens or self._splitter is None:
            return super().encode(text, add_special_tokens)
        ids: list[int] = []
        for piece in self._splitter.split(text):
            if not piece:
                continue
            added = self._added.get(piece)
            if added is not None:
                ids.append(added)
            else:
                ids.extend(self._encode_piece(piece))
        return ids

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        if self._scope is None:
            return tuple(super().encode(piece, False))
        key = (self._scope, piece)
        ids = self._pieces.get(key)
        if ids is not None:
            self._pieces.move_to_end(key)
            return ids
        ids = tuple(super().encode(piece, False))
        self._pieces[key] = ids
        if len(self._pieces) > self.max_pieces:
            self._pieces.popitem(last=False)
        return ids
