"""gpt-oss's harmony format: an answer is a sequence of messages, each on a channel, and only some
are for the user (OpenAI, "The harmony response format", 2025).

    <|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
        {"city":"Paris"}<|call|>
    ... or ...<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

(the prompt ends with `<|start|>assistant`, so an answer begins at its first `<|channel|>`; the
recipient `to=...` may also stand in the role part: `<|start|>assistant to=functions.f<|channel|>
commentary json<|message|>`). Channels, as `--reasoning-parser harmony` splits them:

    analysis                          reasoning_content
    final                             content
    commentary to=functions.NAME      a tool call: handed to the tool parser as one canonical
                                      block, `<|channel|>commentary to=functions.NAME<|message|>
                                      ARGS<|call|>`, which the `harmony` dialect reads
    commentary (no recipient)         content (a preamble the model shows the user)

`<|call|>` and `<|return|>` end the turn (they are end tokens of gpt-oss's generation config, so a
streamed answer often stops before them: a message the text ends in is complete all the same).
Streaming holds back only what may still be a marker; each feed returns the reasoning and the
content it completed, in order, so streamed pieces reassemble to the non-streamed split.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)
TERMINATORS = (END, CALL, RETURN)
CALL_OPEN = f"{CHANNEL}commentary to="  # the canonical block the splitter hands on
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")


@dataclass(frozen=True)
class Header:
    channel: str
    recipient: str | None

    @classmethod
    def parse(cls, text: str) -> Header:
        """A message's header text (role, channel, recipient, constraint; no <|message|>)."""
        found = _RECIPIENT.search(text)
        recipient = found.group(1) if found else None
        _, _, after = text.partition(CHANNEL)
        channel = re.split(r"\s|<\|", after.strip(), maxsplit=1)[0] if after else ""
        return cls(channel, recipient)

    @property
    def is_call(self) -> bool:
        return self.channel in ("commentary", "") and bool(self.recipient)


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins one of `markers`."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


class HarmonyStream:
    """One answer's split into reasoning (analysis) and content (final, preambles, calls as
    canonical blocks); densa.openai.reasoning wraps it as the `harmony` reasoning parser."""

    def __init__(self) -> None:
        self._pending = ""
        self._header: Header | None = None  # the message whose body is being read
        self._in_header = False  # between a message's start and its <|message|>
        self._reasoning: list[str] = []
        self._content: list[str] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that `text` completes; `final`: the answer ends here."""
        self._pending += text
        while self._pending and self._step(final):
            pass
        if final:
            self._flush_end()
        reasoning, content = "".join(self._reasoning), "".join(self._content)
        self._reasoning, self._content = [], []
        return reasoning, content

    # ---- states ----------------------------------------------------------------------------
    def _step(self, final: bool) -> bool:
        """Consume what can be decided; False when waiting for more text."""
        if self._header is not None:
            return self._body(final)
        if self._in_header:
            idx = self._pending.find(MESSAGE)
            if idx < 0:
                return False
            self._open(Header.parse(self._pending[:idx]))
            self._pending = self._pending[idx + len(MESSAGE) :]
            return True
        return self._between(final)

    def _between(self, final: bool) -> bool:
        """Outside a message: a new one starts at <|start|> or <|channel|>; other text (a
        model that writes no header) is content."""
        hits = [i for i in (self._pending.find(START), self._pending.find(CHANNEL)) if i >= 0]
        if hits:
            idx = min(hits)
            self._emit_content(self._pending[:idx])
            self._pending = self._pending[idx:]
            self._in_header = True
            return True
        held = 0 if final else partial_suffix(self._pending, (START, CHANNEL))
        self._emit_content(self._pending[: len(self._pending) - held])
        self._pending = self._pending[len(self._pending) - held :]
        return False

    def _body(self, final: bool) -> bool:
        hits = [(i, t) for t in TERMINATORS if (i := self._pending.find(t)) >= 0]
        if hits:
            idx, terminator = min(hits)
            self._emit_body(self._pending[:idx])
            self._pending = self._pending[idx + len(terminator) :]
            self._close()
            return True
        held = 0 if final else partial_suffix(self._pending, TERMINATORS)
        self._emit_body(self._pending[: len(self._pending) - held])
        self._pending = self._pending[len(self._pending) - held :]
        return False

    def _open(self, header: Header) -> None:
        self._header, self._in_header = header, False
        if header.is_call:
            self._content.append(f"{CALL_OPEN}{header.recipient}{MESSAGE}")

    def _close(self) -> None:
        assert self._header is not None
        if self._header.is_call:
            self._content.append(CALL)
        self._header = None

    def _flush_end(self) -> None:
        """The text ended: a message cut short is complete as far as it goes."""
        if self._in_header:  # a header that never reached its body says nothing
            self._pending, self._in_header = "", False
        if self._header is not None:
            self._emit_body(self._pending)
            self._pending = ""
            self._close()

    def _emit_body(self, text: str) -> None:
        assert self._header is not None
        if not text:
            return
        if self._header.channel == "analysis":
            self._reasoning.append(text)
        else:
            self._content.append(text)

    def _emit_content(self, text: str) -> None:
        if text:
            self._content.append(text)
