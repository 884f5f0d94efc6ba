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
# A recipient runs up to a space or a marker: `to=<|constrain|>json` names none (an empty one).
_RECIPIENT = re.compile(r"to=([^\s<]*)")
FUNCTIONS = "functions."  # the namespace of the request's tools; other recipients are built-ins
# Markers that open a new message: inside a body without its terminator, the body ends there
# (a model that skipped <|end|> must not spill the next header into this message's channel).
OPENERS = (START, CHANNEL)


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
        """A call to one of the request's functions (`to=functions.NAME`)."""
        return (
            self.channel in ("commentary", "")
            and self.recipient is not None
            and self.recipient.startswith(FUNCTIONS)
            and len(self.recipient) > len(FUNCTIONS)
        )

    @property
    def is_hidden(self) -> bool:
        """A message to a recipient that is not one of the request's functions (a built-in tool
        such as `browser.search`, or a malformed one): neither content nor a call."""
        return self.recipient is not None and not self.is_call


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

    def __init__(self, keep_calls: bool = True) -> None:
        self._keep_calls = keep_calls  # False: the request parses no calls; call messages dropped
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
        model that writes no header) is content, and a stray marker is dropped."""
        hits = [(i, m) for m in MARKERS if (i := self._pending.find(m)) >= 0]
        if hits:
            idx, marker = min(hits)
            self._emit_content(self._pending[:idx])
            if marker in OPENERS:
                self._pending = self._pending[idx:]
                self._in_header = True
            else:
                self._pending = self._pending[idx + len(marker) :]
            return True
        held = 0 if final else partial_suffix(self._pending, MARKERS)
        self._emit_content(self._pending[: len(self._pending) - held])
        self._pending = self._pending[len(self._pending) - held :]
        return False

    def _body(self, final: bool) -> bool:
        """Inside a message: it ends at its terminator, or where the next message opens; any
        other marker in it is dropped (never content)."""
        ends = (*TERMINATORS, *OPENERS, MESSAGE, CONSTRAIN)
        hits = [(i, t) for t in ends if (i := self._pending.find(t)) >= 0]
        if hits:
            idx, marker = min(hits)
            self._emit_body(self._pending[:idx])
            if marker in (MESSAGE, CONSTRAIN):
                self._pending = self._pending[idx + len(marker) :]
                return True
            consumed = len(marker) if marker in TERMINATORS else 0  # an opener starts the next
            self._pending = self._pending[idx + consumed :]
            self._close()
            return True
        held = 0 if final else partial_suffix(self._pending, ends)
        self._emit_body(self._pending[: len(self._pending) - held])
        self._pending = self._pending[len(self._pending) - held :]
        return False

    def _open(self, header: Header) -> None:
        self._header, self._in_header = header, False
        if self._hands_on(header):
            self._content.append(f"{CALL_OPEN}{header.recipient}{MESSAGE}")

    def _close(self) -> None:
        assert self._header is not None
        if self._hands_on(self._header):
            self._content.append(CALL)
        self._header = None

    def _hands_on(self, header: Header) -> bool:
        """A call handed to the tool parser as its canonical block."""
        return header.is_call and self._keep_calls

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
        if not text or self._header.is_hidden or (self._header.is_call and not self._keep_calls):
            return
        if self._header.channel == "analysis":
            self._reasoning.append(text)
        else:
            self._content.append(text)

    def _emit_content(self, text: str) -> None:
        if text:
            self._content.append(text)
