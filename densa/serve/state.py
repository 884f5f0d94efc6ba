"""What the server's routes share: the API options and the server state (`app.state.densa`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from fastapi import Request

from densa.engine.client import EngineClient
from densa.ipc.messages import ServedModel
from densa.openai import prepare
from densa.openai.errors import APIError, model_not_found, shutting_down
from densa.openai.prepare import DEFAULT_BODY_TIMEOUT
from densa.openai.reasoning import ReasoningFormat, reasoning_format
from densa.openai.responses import TokenTexts
from densa.openai.tools.formats import (
    DEFAULT_TOOL_FORMAT,
    FALLBACK_FORMAT,
    ToolCallFormat,
    resolve_format,
    tool_format,
)
from densa.openai.unknown_fields import IgnoredFieldLog
from densa.serve.auth import ApiKeys
from densa.serve.disagg import PlacementPolicy, PrefillPeers
from densa.serve.metrics import ServerMetrics
from densa.serve.tracking import RequestRecord
from densa.text.tokenizer import Tokenizer
from densa.utils.heap import return_free_heap
from densa.utils.logging import get_logger

logger = get_logger(__name__)
request_log = get_logger("densa.requests")


@dataclass(frozen=True)
class ApiOptions:
    """How the API reads requests and writes answers (docs/serving.md)."""

    strict_api: bool = False  # unknown request fields are a 400 (else dropped, with a warning)
    served_model_names: tuple[str, ...] = ()  # ids clients may send as "model" (): the engine's
    accept_any_model_name: bool = False  # any "model" is served (responses echo it)
    reasoning_parser: str | None = None  # openai/reasoning.py: REASONING_FORMATS
    chat_template: str | None = None  # replaces the model's chat template (its text)


@dataclass
class ServerState:
    """What the routes share; lives on `app.state.densa`. The engine's facts (served, tokenizer,
    token_texts) are filled in when the engine has started (the app's lifespan)."""

    engine: EngineClient
    max_body_bytes: int
    metrics: ServerMetrics
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    request_timeout: float | None = None  # seconds per request, then it is aborted (504)
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT  # seconds to receive a body (then 408)
    tool_call_format: str = DEFAULT_TOOL_FORMAT  # as asked for ("auto": the chat template's)
    # The dialect served, bound to the tokenizer when the engine has started.
    tool_format: ToolCallFormat = field(default_factory=lambda: tool_format(FALLBACK_FORMAT))
    created: int = field(default_factory=lambda: int(time.time()))
    is_draining: bool = False  # set on SIGINT/SIGTERM: new requests get 503 while old ones finish
    num_open_responses: int = 0  # generation responses started and not yet counted and logged
    tokenizer: Tokenizer | None = None  # the front's own copy of the engine's tokenizer
    token_texts: TokenTexts | None = None
    prefill_peers: PrefillPeers = field(default_factory=PrefillPeers)  # decode role
    # Who may name a prefill worker (decode role): the router's signed token or the allowlist.
    placement: PlacementPolicy = field(default_factory=PlacementPolicy)
    # Huge bodies one at a time, with a bounded share of CPU (prepare.LargeBodyGate).
    large_bodies: prepare.LargeBodyGate = field(default_factory=prepare.LargeBodyGate)
    api: ApiOptions = field(default_factory=ApiOptions)
    ignored_log: IgnoredFieldLog = field(default_factory=IgnoredFieldLog)

    def on_engine_started(self, served: ServedModel) -> None:
        files = served.tokenizer
        if self.api.chat_template is not None:
            files = dataclasses.replace(files, chat_template=self.api.chat_template)
        markers = self.reasoning_format.markers if self.reasoning_format else ()
        self.tokenizer = Tokenizer(files, served.eos_token_ids, shown_special_tokens=markers)
        self.token_texts = TokenTexts(self.tokenizer)
        self.tool_format = resolve_format(self.tool_call_format, self.tokenizer)
        logger.info("tool calls: %s dialect (--tool-call-format %s)", self.tool_format.name,
                    self.tool_call_format)  # fmt: skip
        # Parsing a large tokenizer.json peaks ~90 MB above what the tokenizer keeps (150k
        # tokens): give the heap's free pages back rather than hold them for the server's life.
        return_free_heap()

    @property
    def reasoning_format(self) -> ReasoningFormat | None:
        parser = self.api.reasoning_parser
        return reasoning_format(parser) if parser else None

    @property
    def served(self) -> ServedModel:
        return self.engine.served

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The ids clients may send as "model" (--served-model-name a b), the first the main one."""
        return self.api.served_model_names or (self.served.name,)

    def has_model(self, model: str) -> bool:
        return self.api.accept_any_model_name or model in self.served_model_names

    def tokenizer_for(self, model: str | None) -> Tokenizer:
        """The tokenizer, for requests that need no engine (/tokenize); `model` optional."""
        if self.tokenizer is None:
            raise engine_not_running(self.engine)
        if model is not None and not self.has_model(model):
            raise model_not_found(model, self.served_model_names)
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.served.max_model_len

    def check_can_serve(self, model: str) -> Tokenizer:
        """Raise the 503 / 404 this request gets; else the tokenizer to prepare it with."""
        if self.is_draining:
            raise shutting_down()
        if not self.engine.is_alive or self.tokenizer is None:
            raise engine_not_running(self.engine)
        if not self.has_model(model):
            raise model_not_found(model, self.served_model_names)
        return self.tokenizer

    def start(self, record: RequestRecord) -> None:
        self.num_open_responses += 1

    def finish(self, record: RequestRecord) -> None:
        """Count and log a request once its response is over (RequestTracking calls this)."""
        self.num_open_responses -= 1
        self.metrics.observe(record)
        request_log.info(record.log_line())


def server_state(request: Request) -> ServerState:
    return request.app.state.densa


def engine_not_running(engine: EngineClient) -> APIError:
    if engine.has_failed:
        message = f"the engine failed and was not restarted ({engine.failure}); see the log"
    else:
        message = f"the engine is not running ({engine.state}); retry shortly"
    return APIError(
        503, message, "engine_not_running", error_type="server_error", headers={"Retry-After": "1"}
    )
