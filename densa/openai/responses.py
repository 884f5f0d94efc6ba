"""Engine outputs -> OpenAI response bodies and stream chunks, for chat and for legacy completions.

A formatter is created per request and holds what its chunks share (id, creation time, model name)
plus, for completions, the running text offset that legacy logprobs report.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from pydantic import BaseModel

from densa.ipc.messages import TokenLogprobs
from densa.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from densa.openai.reasoning import ReasoningSplitter
from densa.openai.tools.deltas import to_deltas
from densa.openai.tools.formats import ToolCallFormat
from densa.openai.tools.models import ResponseFunctionCall, ResponseToolCall
from densa.openai.tools.parser import ParsedOutput, ToolCallParser, parse_output
from densa.text.output import RequestOutput
from densa.text.tokenizer import Tokenizer


@dataclass
class Generation:
    """A whole generation, gathered from a request's outputs (non-streaming responses)."""

    text: str
    logprobs: list[TokenLogprobs]
    final: RequestOutput  # the last output: finish reason and token counts
    # SamplingParams.prompt_logprobs: prompt tokens 1 .. P - 1 (echo).
    prompt_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)


def usage_of(final: RequestOutput) -> Usage:
    return Usage(
        prompt_tokens=final.num_prompt_tokens,
        completion_tokens=final.num_output_tokens,
        total_tokens=final.num_prompt_tokens + final.num_output_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=final.num_cached_tokens),
    )


# ---- token text for logprobs --------------------------------------------------------------------
@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """GPT-2 byte-level BPE spells each byte as one printable character; this maps it back."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + i) for i, b in enumerate(others)})
    return {c: b for b, c in chars.items()}


class TokenTexts:
    """Token id -> (text, UTF-8 bytes), cached: the same few thousand tokens recur constantly.

    A token may hold part of a multi-byte character: its text is then "\ufffd" but its bytes are
    exact, which is what OpenAI's `bytes` field is for (clients join bytes across tokens).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            piece = self._tokenizer.convert_ids_to_tokens([token_id])[0]
            entry = self._cache[token_id] = (text, list(_token_bytes(piece, text)))
        return entry

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


def _token_bytes(piece: str, text: str) -> bytes:
    # Byte-level vocabularies (GPT-2, Llama 3, SmolLM) spell the raw bytes; others use the text.
    table = _byte_level_chars()
    if all(c in table for c in piece):
        raw = bytes(table[c] for c in piece)
        if raw.decode("utf-8", errors="replace") == text:
            return raw
    return text.encode("utf-8")


# ---- chat ---------------------------------------------------------------------------------------
@dataclass
class ChatFormatter:
    response_id: str
    created: int
    model: str
    tokens: TokenTexts
    num_logprobs: int | None  # None = the client did not ask for logprobs
    # Set when the request offers tools: the answer is read for calls in this format.
    tool_format: ToolCallFormat | None = None
    _parser: ToolCallParser | None = field(default=None, init=False)
    _num_calls: int = field(default=0, init=False)  # calls streamed so far
    # Set with --reasoning-parser: the reasoning is split off first; calls are read from the rest.
    reasoning: ReasoningSplitter | None = None

    def response(self, generation: Generation) -> ChatCompletionResponse:
        reasoning, text = "", generation.text
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split_all(text)
        parsed = (
            parse_output(self.tool_format, text)
            if self.tool_format is not None
            else ParsedOutput(text)
        )
        calls = [
            ResponseToolCall(
                id=c.call_id, function=ResponseFunctionCall(name=c.name, arguments=c.arguments)
            )
            for c in parsed.tool_calls
        ]
        message = AssistantMessage(
            content=parsed.content if parsed.content or not calls else None,
            tool_calls=calls or None,
            reasoning_content=reasoning or None,
        )
        choice = ChatChoice(
            message=message,
            logprobs=self._logprobs(generation.logprobs),
            finish_reason=_finish_reason(generation.final.finish_reason, len(calls)),
        )
        return ChatCompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=usage_of(generation.final),
        )

    def stream_start(self) -> list[BaseModel]:
        # OpenAI's first chunk announces the role before any content arrives.
        return [self._chunk(ChatChunkChoice(delta=ChatDelta(role="assistant", content="")))]

    def stream_chunks(self, output: RequestOutput) -> list[BaseModel]:
        if self.reasoning is None:
            return self._answer_chunks(output)
        split = self.reasoning.feed(output.new_text, final=output.finished)
        if not split.reasoning:
            return self._answer_chunks(dataclasses.replace(output, new_text=split.content))
        # The reasoning first, with this output's logprobs; then the answer's chunks.
        delta = ChatDelta(reasoning_content=split.reasoning)
        logprobs = self._logprobs(output.new_logprobs)
        first = self._chunk(ChatChunkChoice(delta=delta, logprobs=logprobs))
        rest = dataclasses.replace(output, new_text=split.content, new_logprobs=[])
        return [first, *self._answer_chunks(rest)]

    def _answer_chunks(self, output: RequestOutput) -> list[BaseModel]:
        if self.tool_format is not None:
            return self._tool_chunks(output)
        if not (output.new_text or output.new_logprobs or output.finished):
            return []  # text held back (a partial character or a possible stop string)
        choice = ChatChunkChoice(
            delta=ChatDelta(content=output.new_text) if output.new_text else ChatDelta(),
            logprobs=self._logprobs(output.new_logprobs),
            finish_reason=output.finish_reason if output.finished else None,
        )
        return [self._chunk(choice)]

    def _tool_chunks(self, output: RequestOutput) -> list[BaseModel]:
        """Content and tool-call deltas as the parser finds them; the finish reason last."""
        assert self.tool_format is not None
        if self._parser is None:
            self._parser = ToolCallParser(self.tool_format)
        events = self._parser.feed(output.new_text)
        if output.finished:
            events += self._parser.finish()
        choices = [
            ChatChunkChoice(
                delta=ChatDelta(
                    content=d.content, tool_calls=[d.tool_call] if d.tool_call else None
                )
            )
            for d in to_deltas(events)
        ]
        logprobs = self._logprobs(output.new_logprobs)
        if logprobs is not None and not choices:
            choices.append(ChatChunkChoice(delta=ChatDelta()))
        if choices:
            choices[0].logprobs = logprobs
        if output.finished:
            reason = _finish_reason(output.finish_reason, len(self._parser.calls))
            choices.append(ChatChunkChoice(delta=ChatDelta(), finish_reason=reason))
        return [self._chunk(choice) for choice in choices]

    def usage_chunk(self, final: RequestOutput) -> BaseModel:
        return ChatCompletionChunk(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=usage_of(final),
        )

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.response_id, created=self.created, model=self.model, choices=[choice]
        )

    def _logprobs(self, entries: list[TokenLogprobs]) -> ChatLogprobs | None:
        if self.num_logprobs is None or not entries:
            return None
        return ChatLogprobs(content=[self._token_logprob(e) for e in entries])

    def _token_logprob(self, entry: TokenLogprobs) -> TokenLogprob:
        text, raw = self.tokens.get(entry.token_id)
        top = [self._top(token_id, logprob) for token_id, logprob in entry.top]
        return TokenLogprob(token=text, logprob=entry.logprob, bytes=raw, top_logprobs=top)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text, raw = self.tokens.get(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=raw)


def _finish_reason(reason: str | None, num_calls: int) -> str | None:
    """OpenAI says "tool_calls" when the answer ended by making calls."""
    return "tool_calls" if reason == "stop" and num_calls else reason


# ---- legacy completions -------------------------------------------------------------------------
@dataclass(frozen=True)
class EchoedPrompt:
    """With `echo`, the prompt that comes back before the completion."""

    text: str
    token_ids: list[int]


@dataclass
class CompletionFormatter:
    response_id: str
    created: int
    model: str
    tokens: TokenTexts
    num_logprobs: int | None
    echo: EchoedPrompt | None = None
    _text_offset: int = field(default=0, init=False)  # chars of token text reported so far
    _echoed: bool = field(default=False, init=False)  # the stream has sent the prompt

    def response(self, generation: Generation) -> CompletionResponse:
        prompt = self._prompt_logprobs(generation.prompt_logprobs)
        logprobs = self._logprobs(generation.logprobs, prompt)
        choice = CompletionChoice(
            text=(self.echo.text if self.echo else "") + generation.text,
            logprobs=logprobs,
            finish_reason=generation.final.finish_reason,
        )
        return self._body(choice, usage_of(generation.final))

    def stream_start(self) -> list[BaseModel]:
        return []

    def stream_chunks(self, output: RequestOutput) -> list[BaseModel]:
        """With echo, the prompt (and its logprobs) is a chunk of its own, before the first."""
        chunks: list[BaseModel] = []
        if self.echo is not None and not self._echoed:
            self._echoed = True
            prompt = self._prompt_logprobs(output.prompt_logprobs)
            choice = CompletionChoice(text=self.echo.text, logprobs=self._logprobs([], prompt))
            chunks.append(self._body(choice))
        if output.new_text or output.new_logprobs or output.finished:
            choice = CompletionChoice(
                text=output.new_text,
                logprobs=self._logprobs(output.new_logprobs),
                finish_reason=output.finish_reason if output.finished else None,
            )
            chunks.append(self._body(choice))
        return chunks

    def usage_chunk(self, final: RequestOutput) -> BaseModel:
        return CompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=usage_of(final),
        )

    def _body(self, choice: CompletionChoice, usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=usage,
        )

    def _prompt_logprobs(self, entries: list[TokenLogprobs]) -> CompletionLogprobs | None:
        """The echoed prompt's tokens (None without echo and logprobs): the first has no
        logprob; its text offsets count from the start of the prompt."""
        if self.echo is None or self.num_logprobs is None or not self.echo.token_ids:
            return None
        result = CompletionLogprobs()
        self._add(result, self.echo.token_ids[0], None, None)
        for entry in entries:
            self._add(result, entry.token_id, entry.logprob, entry.top)
        self._text_offset = len(self.echo.text)  # the completion starts after the prompt
        return result

    def _logprobs(
        self, entries: list[TokenLogprobs], prompt: CompletionLogprobs | None = None
    ) -> CompletionLogprobs | None:
        if self.num_logprobs is None or not (entries or prompt):
            return None
        result = prompt or CompletionLogprobs()
        for entry in entries:
            self._add(result, entry.token_id, entry.logprob, entry.top)
        return result

    def _add(
        self,
        result: CompletionLogprobs,
        token_id: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
    ) -> None:
        text = self.tokens.text(token_id)
        result.tokens.append(text)
        result.token_logprobs.append(logprob)
        result.top_logprobs.append(
            None if top is None else {self.tokens.text(t): lp for t, lp in top}
        )
        result.text_offset.append(self._text_offset)
        self._text_offset += len(text)
