"""From an HTTP request to an engine call: read and validate the body, tokenize, check lengths.

Everything here fails with an APIError (a 4xx) before the engine sees the request, so a bad request
changes nothing on the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from densa.cache.scope import CacheScope
from densa.ipc.messages import ServedModel
from densa.openai import fim
from densa.openai.errors import APIError, ClientDisconnected, bad_request, from_validation_error
from densa.openai.infill import InfillRequest
from densa.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from densa.openai.templates import template_variables
from densa.openai.tools.formats import HERMES, ToolCallFormat
from densa.openai.tools.plan import (
    NO_TOOLS,
    ToolPlan,
    ToolRequestError,
    output_constraint,
    plan_tools,
)
from densa.openai.tools.render import render_messages
from densa.openai.unknown_fields import drop_fields, unknown_field_locs
from densa.sampling_params import SamplingParams
from densa.text.tokenizer import ChatTemplateError, Tokenizer

RequestT = TypeVar("RequestT", bound=BaseModel)
# Valid JSON can spell a lone UTF-16 surrogate ("\ud800"); no UTF-8 text can hold one.
_SURROGATE = re.compile("[\ud800-\udfff]")


# ---- the body -----------------------------------------------------------------------------------
# Bodies this large go through the LargeBodyGate. A normal chat request is a few kilobytes and
# never waits there.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_BODY_TIMEOUT = 30.0  # seconds a client may take to send its whole body (then 408)
LARGE_BODY_BYTES = 1024 * 1024
LARGE_BODY_DUTY = 0.05  # the most of the front's CPU time large bodies may take, sustained
MAX_LARGE_BODY_PAUSE_S = 1.0


class LargeBodyGate:
    """Large bodies are read and parsed one at a time, FIFO, and after each the next waits until
    large-body work has taken at most `duty` of the event loop's CPU time.

    The waiting bodies stay unread in their sockets, so their senders block too: a flood of
    huge requests gets a bounded share of the front's CPU (and, paced by it, of its own), and
    the rest goes to normal requests and to the engine on the same cores. The pause is measured
    in the event loop thread's CPU time, not wall time: a huge body trickling in slowly costs
    little CPU, so it does not hold up the next one for long (the body timeout bounds it).
    """

    def __init__(
        self,
        duty: float = LARGE_BODY_DUTY,
        max_pause_s: float = MAX_LARGE_BODY_PAUSE_S,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        self.duty = duty
        self.max_pause_s = max_pause_s
        self.cpu_clock = cpu_clock
        self._lock = asyncio.Lock()
        self._not_before = 0.0  # monotonic time the next large body may start

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        async with self._lock:
            pause = self._not_before - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
            cpu = self.cpu_clock()
            try:
                yield
            finally:
                spent = self.cpu_clock() - cpu
                rest = min(spent * (1 / self.duty - 1), self.max_pause_s)
                self._not_before = time.monotonic() + rest


async def read_json(
    request: Request,
    max_bytes: int,
    timeout: float | None = None,
    large_bodies: LargeBodyGate | None = None,
    then: Callable[[Any], Any] = lambda data: data,
) -> Any:
    """The body as JSON, refusing oversized (413), slow (408), non-UTF-8 and malformed (400)
    bodies, and bodies holding text no UTF-8 encoder can write (400 naming the field)."""
    declared = _declared_length(request)
    if declared is not None and declared > max_bytes:
        raise _too_large(max_bytes)
    large = declared is None or declared > LARGE_BODY_BYTES
    if large and large_bodies is not None:
        async with large_bodies.admit():  # `then` too: validating a huge body costs as much
            return then(await _read_json(request, max_bytes, timeout))
    return then(await _read_json(request, max_bytes, timeout))


def _declared_length(request: Request) -> int | None:
    """Content-Length, if it is a decimal number (ASCII digits: "²".isdigit() is true too)."""
    declared = request.headers.get("content-length", "")
    return int(declared) if declared.isascii() and declared.isdigit() else None


async def read_request(
    model: type[RequestT],
    request: Request,
    max_bytes: int,
    timeout: float | None = None,
    large_bodies: LargeBodyGate | None = None,
    ignored: list[str] | None = None,
) -> RequestT:
    """read_json, validated as `model` (400 naming the field; unknown fields: see parse)."""
    parsed = await read_json(
        request, max_bytes, timeout, large_bodies, lambda d: parse(model, d, ignored)
    )
    assert isinstance(parsed, model)
    return parsed


async def _read_json(request: Request, max_bytes: int, timeout: float | None) -> Any:
    try:
        async with asyncio.timeout(timeout):
            body = await _read_body(request, max_bytes)
    except TimeoutError as exc:
        message = f"the request body did not arrive within {timeout:g} s; send it at once"
        raise APIError(408, message, code="request_body_timeout") from exc
    except ClientDisconnect as exc:  # gone mid-body: nobody to answer (499, not a server error)
        raise ClientDisconnected() from exc
    data = _decode_json(body)
    field = first_unencodable_field(data)
    if field is not None:
        message = f"{field} holds a lone UTF-16 surrogate, which is not text; send valid Unicode"
        raise bad_request(message, code="invalid_encoding", param=field)
    return data


async def _read_body(request: Request, max_bytes: int) -> bytearray:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:  # a chunked body has no Content-Length to check up front
            raise _too_large(max_bytes)
    return body


def _decode_json(body: bytearray) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        message = f"the request body is not valid UTF-8 (bad byte at offset {exc.start})"
        raise bad_request(message, code="invalid_encoding") from exc
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON: {exc}", "invalid_json") from exc
    except RecursionError as exc:  # [[[[...]]]] nested deeper than the parser's stack
        raise bad_request("the request body nests too deeply", "invalid_json") from exc


def first_unencodable_field(data: Any) -> str | None:
    """The first field (OpenAI spelling, e.g. `messages[0].content`) whose text, or key, holds a
    lone surrogate; None if every string can be encoded as UTF-8."""
    for path, value in _strings(data):
        if not value.isascii() and _SURROGATE.search(value):  # isascii: a fast C pass
            return path or "the request body"
    return None


def _strings(data: Any) -> Iterator[tuple[str, str]]:
    """(path, text) of every string in parsed JSON, keys included, in document order. Iterative:
    the parser already bounded the depth, and a deep body must not exhaust the stack here."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            yield path, value
        elif isinstance(value, dict):
            items = []
            for key, item in value.items():
                child = f"{path}.{key}" if path else key
                yield child, key
                items.append((child, item))
            stack.extend(reversed(items))
        elif isinstance(value, list):
            stack.extend(reversed([(f"{path}[{i}]", item) for i, item in enumerate(value)]))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _too_large(max_bytes: int) -> APIError:
    message = f"the request body exceeds the server's limit of {max_bytes} bytes"
    return APIError(413, message, code="request_too_large")


def parse(model: type[RequestT], data: Any, ignored: list[str] | None = None) -> RequestT:
    """`data` validated as `model` (400 naming the field). Unknown fields are refused when
    `ignored` is None (--strict-api); else they are dropped and their names added to it."""
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", "invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        names = drop_fields(data, unknown_field_locs(exc)) if ignored is not None else []
        if ignored is None or not names:
            raise from_validation_error(exc) from exc
        ignored.extend(names)
    return parse(model, data, None)  # a field still wrong after that is the client's 400


# ---- prompts and lengths ------------------------------------------------------------------------
def max_prompt_bytes(max_model_len: int, max_token_bytes: int) -> int:
    """Text longer than this cannot fit the context, whatever the tokenizer makes of it.

    No token spells more than `max_token_bytes` bytes of text, so N bytes need at least
    N / max_token_bytes tokens. The factor 2 leaves room for normalizers that shorten text
    (Unicode composition) before it is split.
    """
    return 2 * max_model_len * max_token_bytes


def tool_plan(fmt: ToolCallFormat, body: ChatCompletionRequest) -> ToolPlan:
    """What tools the prompt shows and what constrains the answer (400 naming the field)."""
    try:
        return plan_tools(
            fmt,
            body.tools,
            body.tool_choice,
            body.parallel_tool_calls,
            body.response_format,
            body.structured_outputs,
        )
    except ToolRequestError as exc:
        raise bad_request(str(exc), code="invalid_value", param=exc.param) from exc


def completion_plan(body: CompletionRequest) -> ToolPlan:
    """A completion's output constraint (structured_outputs), as a plan without tools."""
    if body.structured_outputs is None:
        return NO_TOOLS
    return ToolPlan([], output_constraint(body.structured_outputs), False)


async def chat_prompt(
    tokenizer: Tokenizer,
    body: ChatCompletionRequest,
    max_model_len: int,
    plan: ToolPlan = NO_TOOLS,
    fmt: ToolCallFormat = HERMES,
    offload: bool = True,
) -> list[int]:
    """The conversation as prompt tokens, with the plan's tools rendered (openai/tools/render.py).
    A final assistant message is continued, not answered: the prompt ends inside that message,
    so the model writes on from its last word (one that made tool calls is answered instead)."""
    if len(body.messages) > max_model_len:
        message = f"{len(body.messages)} messages cannot fit a {max_model_len}-token context"
        raise bad_request(message, code="context_length_exceeded", param="messages")
    check_chat_size(tokenizer, chat_text_bytes(body, plan.tools), max_model_len)
    renders_tools = tokenizer.template_renders_tools
    messages = render_messages(
        [m.to_template() for m in body.messages], plan.tools, fmt, renders_tools,
        tokenizer.template_renders_tool_calls,
    )  # fmt: skip
    tools = plan.tools if renders_tools and plan.tools else None
    last = body.messages[-1]
    continue_final = last.role == "assistant" and not last.tool_calls
    variables = template_variables(tokenizer, body)
    try:
        # Rendering and tokenizing a long prompt takes milliseconds: keep the event loop free
        # (unless the caller knows it is cheap: a thread hand-off costs more than a short prompt).
        return await _run(
            offload, tokenizer.encode_chat, messages, tools, continue_final, variables
        )
    except ChatTemplateError as exc:
        raise bad_request(str(exc), code="invalid_messages", param="messages") from exc


async def completion_prompt(
    tokenizer: Tokenizer, body: CompletionRequest, max_model_len: int, offload: bool = True
) -> list[int]:
    if isinstance(body.prompt, str):
        check_text_size(tokenizer, len(body.prompt.encode()), max_model_len, "prompt")
        prompt_ids = await _run(offload, tokenizer.encode, body.prompt)
    else:
        prompt_ids = body.prompt
    if not prompt_ids:
        raise bad_request("the prompt is empty", param="prompt")
    return prompt_ids


# ---- fill-in-the-middle (openai/fim.py) ---------------------------------------------------------
async def fim_completion_prompt(
    tokenizer: Tokenizer, body: CompletionRequest, max_model_len: int
) -> fim.FimPrompt:
    """A completion with `suffix`: the prompt and the suffix around the model's FIM tokens."""
    assert isinstance(body.prompt, str) and body.suffix is not None  # CompletionRequest checks
    check_fim(tokenizer, "suffix")
    num_bytes = len(body.prompt.encode()) + len(body.suffix.encode())
    check_text_size(tokenizer, num_bytes, max_model_len, "prompt")
    return await asyncio.to_thread(fim.completion_prompt, tokenizer, body.prompt, body.suffix)


async def infill_prompt(
    tokenizer: Tokenizer, body: InfillRequest, max_model_len: int
) -> tuple[fim.FimPrompt, bool]:
    """llama.cpp's /infill prompt, and whether input_extra was cut to fit. The context keeps
    room for n_predict tokens (one when it runs to the end of the context); the oldest extra
    context goes first, the prefix, suffix and prompt never (check_lengths refuses them)."""
    check_fim(tokenizer, "input_prefix")
    parts = (body.input_prefix, body.input_suffix, body.prompt)
    check_text_size(tokenizer, sum(len(p.encode()) for p in parts), max_model_len, "input_prefix")
    # Chunks beyond what could fit are dropped before they cost a tokenizer pass.
    extra, limit = body.extra, max_prompt_bytes(max_model_len, tokenizer.max_token_bytes)
    sizes = [len(c.text.encode()) + len(c.filename.encode()) for c in extra]
    total, first = sum(sizes), 0
    while first < len(extra) and total > limit:  # the oldest first, each size counted once
        total -= sizes[first]
        first += 1
    extra = extra[first:]
    room = max_model_len - (body.requested_max_tokens or 1)
    prompt = await asyncio.to_thread(
        fim.infill_prompt, tokenizer, *parts[:2], extra, body.prompt, room
    )
    return prompt, prompt.num_extra_dropped > 0 or len(extra) < len(body.input_extra)


def check_fim(tokenizer: Tokenizer, param: str) -> None:
    """A 400 naming `param` when the model has no FIM tokens."""
    try:
        fim.fim_tokens(tokenizer)
    except fim.FimUnsupported as exc:
        raise bad_request(str(exc), code="unsupported_value", param=param) from exc


async def _run(offload: bool, function: Callable[..., list[int]], *args: Any) -> list[int]:
    return await asyncio.to_thread(function, *args) if offload else function(*args)


def check_text_size(tokenizer: Tokenizer, num_bytes: int, max_model_len: int, param: str) -> None:
    """Refuse text that cannot fit before paying to tokenize it (a 4 MB prompt takes seconds of
    CPU and a gigabyte of tokenizer memory just to learn it is too long)."""
    limit = max_prompt_bytes(max_model_len, tokenizer.max_token_bytes)
    if num_bytes > limit:
        message = (
            f"the {param} hold {num_bytes} bytes of text, more than this model's "
            f"{max_model_len}-token context can take (at most {limit} bytes); shorten the {param}"
        )
        raise bad_request(message, code="context_length_exceeded", param=param)


def check_chat_size(tokenizer: Tokenizer, parts: dict[str, int], max_model_len: int) -> None:
    """check_text_size over every part of a chat body that becomes prompt text, together: the
    error names the largest part (`parts`: chat_text_bytes)."""
    limit = max_prompt_bytes(max_model_len, tokenizer.max_token_bytes)
    num_bytes = sum(parts.values())
    if num_bytes > limit:
        largest = max(parts, key=lambda name: parts[name])
        message = (
            f"the prompt text of this request holds {num_bytes} bytes ({largest}: "
            f"{parts[largest]}), more than this model's {max_model_len}-token context can take "
            f"(at most {limit} bytes); shorten the {largest}"
        )
        raise bad_request(message, code="context_length_exceeded", param=largest)


def chat_text_bytes(body: ChatCompletionRequest, tools: list[dict[str, Any]]) -> dict[str, int]:
    """The bytes of text each part of a chat body can put into the prompt, before rendering.

    Everything a chat template is given counts: each message's content, name, tool_call_id,
    reasoning and tool calls (ids, names, arguments), the tool definitions the prompt shows (as
    compact JSON, the least text a template can make of them) and the template variables.
    Anthropic's `system` and `tools` and the Responses API's `instructions` and items reach
    here as these same fields (their to_chat translations). A part the template then leaves
    out still counts: a body with more text than any prompt can hold is refused either way.
    """
    return {
        "messages": sum(_message_text_bytes(message) for message in body.messages),
        "tools": _json_bytes(tools) if tools else 0,
        "chat_template_kwargs": (
            _json_bytes(body.chat_template_kwargs) if body.chat_template_kwargs else 0
        ),
    }


def _message_text_bytes(message: ChatMessage) -> int:
    texts = (message.content, message.name, message.tool_call_id, message.reasoning_content)
    num_bytes = sum(len(text.encode()) for text in texts if text)
    if message.tool_calls:
        num_bytes += _json_bytes([call.model_dump() for call in message.tool_calls])
    return num_bytes


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


def check_token_ids(served: ServedModel, prompt_ids: list[int], params: SamplingParams) -> None:
    """Token ids the model has (the engine checks again: this only answers sooner)."""
    vocab = served.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        message = f"token ids out of range [0, {vocab}): {bad[:5]}"
        raise bad_request(message, code="invalid_value", param="prompt")
    bad_stop = [t for t in params.stop_token_ids if t >= vocab]
    if bad_stop:
        message = f"stop_token_ids out of range [0, {vocab}): {bad_stop[:5]}"
        raise bad_request(message, code="invalid_value", param="stop_token_ids")
    bad_bias = [t for t, _ in params.logit_bias if t >= vocab]
    if bad_bias:
        message = f"logit_bias names token ids out of range [0, {vocab}): {bad_bias[:5]}"
        raise bad_request(message, code="invalid_value", param="logit_bias")


def check_lengths(
    max_model_len: int, num_prompt_tokens: int, max_tokens: int | None, params: tuple[str, str]
) -> None:
    """The prompt plus the requested output must fit the context (OpenAI rejects, not truncates).

    params: the names of the prompt field and of the max-tokens field the client used.
    """
    prompt_param, max_tokens_param = params
    if num_prompt_tokens >= max_model_len:
        message = (
            f"this model's context is {max_model_len} tokens, but the {prompt_param} take "
            f"{num_prompt_tokens} tokens (and the answer needs at least one); "
            f"shorten the {prompt_param}"
        )
        raise bad_request(message, code="context_length_exceeded", param=prompt_param)
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        message = (
            f"this model's context is {max_model_len} tokens, but you asked for "
            f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the {prompt_param}, "
            f"{max_tokens} in {max_tokens_param}); lower {max_tokens_param} to at most "
            f"{max_model_len - num_prompt_tokens}"
        )
        raise bad_request(message, code="context_length_exceeded", param=max_tokens_param)


# ---- the prefix-cache scope ---------------------------------------------------------------------
def cache_scope(tenant: str | None, body: ChatCompletionRequest | CompletionRequest) -> str:
    """The prefix-cache namespace (densa/cache/scope.py): requests reuse each other's cached pages
    only within one scope.

    Each part narrows it: the tenant (the identity of the bearer key the request authenticated
    with) separates tenants, `user` separates a tenant's end users, and `cache_salt` lets a client
    opt out of sharing altogether. Parts combine rather than replace, so no salt reaches across
    keys. Because a foreign scope never hits, a tenant cannot learn from response times whether
    another tenant sent a given prompt.
    """
    return CacheScope(tenant=tenant, user=body.user, salt=body.cache_salt).digest()
