"""Literal text in call grammars, with the vocabulary's marker tokens matched as tokens.

A tokenizer splits its added tokens (Qwen's `<tool_call>`, Kimi's `<|tool_call_begin|>`,
DeepSeek's `<｜tool▁calls▁begin｜>`) out of text before anything else, so a model writes such a
marker as that one token. The grammar engine reads most of them as special tokens, which spell
no bytes a string literal could match: a grammar that forces the text `<tool_call>` byte by byte
refuses the very token the model emits (every forced Qwen2.5 call failed that way). So each
literal is written as its pieces: an added token as `<[id]>`, the text around it as a string.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping


def marker_tokens(texts: Iterable[str], added_tokens: Mapping[str, int]) -> dict[str, int]:
    """The added tokens (text -> id) that occur in any of `texts`."""
    texts = [t for t in texts if t]
    return {tok: i for tok, i in added_tokens.items() if tok and any(tok in t for t in texts)}


def literal(text: str, tokens: Mapping[str, int]) -> str:
    """`text` as a Lark expression: strings, with each of `tokens` in it as `<[id]>` ("" if
    `text` is empty)."""
    parts: list[str] = []
    idx = 0
    while idx < len(text):
        hit = _next_token(text, idx, tokens)
        if hit is None:
            parts.append(json.dumps(text[idx:]))  # a JSON string is a valid Lark string literal
            break
        at, token = hit
        if at > idx:
            parts.append(json.dumps(text[idx:at]))
        parts.append(f"<[{tokens[token]}]>")
        idx = at + len(token)
    return " ".join(parts)


def seq(*parts: str) -> str:
    """Lark expressions in sequence, empty ones left out."""
    return " ".join(p for p in parts if p)


def _next_token(text: str, start: int, tokens: Mapping[str, int]) -> tuple[int, str] | None:
    """The first token in text[start:], the longest one where several begin at the same place
    (as the tokenizer matches them)."""
    best: tuple[int, str] | None = None
    for token in tokens:
        at = text.find(token, start)
        if at < 0:
            continue
        if best is None or at < best[0] or (at == best[0] and len(token) > len(best[1])):
            best = (at, token)
    return best
