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
"""

from __future__ import annotations

import re
from collections import OrderedDict

from densa.text.tokenizer import Tokenizer, TokenizerFiles

DEFAULT_MAX_PIECES = 8192


class PieceCachingTokenizer(Tokenizer):
    """A Tokenizer whose `encode(text, add_special_tokens=False)` -- what chat prompts use --
    reuses the ids of text pieces seen before. Mutates only its own cache."""

    def __init__(
        self,
        files: TokenizerFiles,
        eos_token_ids: tuple[int, ...] = (),
        max_pieces: int = DEFAULT_MAX_PIECES,
    ) -> None:
        super().__init__(files, eos_token_ids)
        self.max_pieces = max_pieces
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        added = self.verbatim_added_tokens
        self._added = added or {}
        longest_first = sorted(self._added, key=len, reverse=True)
        self._splitter = (
            re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if added else None
        )

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
        ids = self._pieces.get(piece)
        if ids is not None:
            self._pieces.move_to_end(piece)
            return ids
        ids = tuple(super().encode(piece, False))
        self._pieces[piece] = ids
        if len(self._pieces) > self.max_pieces:
            self._pieces.popitem(last=False)
        return ids
