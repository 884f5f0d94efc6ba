"""Incremental detokenization with stop strings.

Decoding the whole output every step is quadratic, and decoding each token alone breaks multi-byte
characters and word-boundary spaces. So each step decodes a short window: tokens from
`prefix_offset` (already emitted context) to the end, and emits what extends past the text of the
window's prefix. Text is held back while it ends in an incomplete UTF-8 character ("\ufffd"), or
while it could still be the start of a stop string -- exactly the longest tail of the text that
begins some stop string, so a long stop string delays nothing that cannot become it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from densa.text.tokenizer import Tokenizer

# Context tokens re-decoded with each window, so spaces and merges at the boundary come out right.
_CONTEXT_TOKENS = 6


@dataclass
class DetokenizerState:
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # all text decoded so far (stop strings not yet cut)
    num_emitted_chars: int = 0  # text[:num_emitted_chars] has been handed out


class Detokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...],
        include_stop_str: bool,
        skip_special_tokens: bool,
        kept_special_token_ids: tuple[int, ...] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._include_stop = include_stop_str
        self._skip_special = skip_special_tokens
        # Special tokens left out of the text (all of them when skipping, but the kept ones).
        self._skipped = (
            frozenset(tokenizer.all_special_ids) - set(kept_special_token_ids)
            if skip_special_tokens and kept_special_token_ids
            else None
        )
        self._holdback = max((len(s) for s in stop), default=1) - 1
        # Seed the window with the end of the prompt so the first output token decodes in context.
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self._state = DetokenizerState(
            token_ids=list(context), prefix_offset=0, read_offset=len(context)
        )
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that was found (cut from the text)

    @property
    def text(self) -> str:
        return self._state.text

    def add_token(self, token_id: int) -> None:
        state = self._state
        state.token_ids.append(token_id)
        prefix_text = self._decode(state.token_ids[state.prefix_offset : state.read_offset])
        full_text = self._decode(state.token_ids[state.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            state.text += full_text[len(prefix_text) :]
            state.prefix_offset = state.read_offset
            state.read_offset = len(state.token_ids)

    def check_stop(self) -> bool:
        """Cut the text at the first stop string; True if one was found."""
        if self.stopped or not self._stop:
            return self.stopped
        text = self._state.text
        search_from = max(0, self._state.num_emitted_chars - self._holdback)
        hits = [(text.find(s, search_from), s) for s in self._stop]
        hits = [(idx, s) for idx, s in hits if idx >= 0]
        if not hits:
            return False
        idx, stop = min(hits)
        self._state.text = text[: idx + len(stop)] if self._include_stop else text[:idx]
        self.stopped = True
        self.stop_string = stop
        return True

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; holds back a possible stop-string prefix unless finished."""
        state = self._state
        end = len(state.text)
        if not (finished or self.stopped):
            end -= self._stop_prefix_len(state.text, state.num_emitted_chars)
        end = max(end, state.num_emitted_chars)
        delta = state.text[state.num_emitted_chars : end]
        state.num_emitted_chars = end
        return delta

    def _stop_prefix_len(self, text: str, start: int) -> int:
        """Length of the longest tail of text[start:] that a stop string begins with (a proper
        prefix: a whole stop string would have been cut by check_stop)."""
        longest = 0
        for stop in self._stop:
            first = max(start, len(text) - len(stop) + 1)
            idx = text.find(stop[0], first)
            while idx != -1 and len(text) - idx > longest:
                if stop.startswith(text[idx:]):
                    longest = len(text) - idx
                    break
                idx = text.find(stop[0], idx + 1)
        return longest

    def _decode(self, token_ids: list[int]) -> str:
        if self._skipped is not None:
            kept = [t for t in token_ids if t not in self._skipped]
            return self._tokenizer.decode(kept, skip_special_tokens=False)
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special)
