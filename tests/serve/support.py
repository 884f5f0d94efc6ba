"""Helpers for the server tests: a real uvicorn server on a free loopback port (on a thread of the
test process), over a real engine core in its own process -- the split `densa serve` runs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import openai
from fastapi import FastAPI

from densa.engine.client import ClientOptions, EngineClient
from densa.engine.launch import ProcessLauncher
from densa.ipc.messages import AddRequest, EngineStats, RequestDelta
from densa.serve import build_app, serve_in_thread
from densa.setup.args import EngineArgs
from densa.text.tokenizer import Tokenizer

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 512


def engine_args(model_dir: Path, **overrides: Any) -> EngineArgs:
    settings: dict[str, Any] = {
        "model": str(model_dir),
        "served_model_name": MODEL_NAME,
        "kv_cache_memory": "64MiB",
        "max_model_len": MAX_MODEL_LEN,
    }
    settings.update(overrides)
    return EngineArgs(**settings)


def make_engine(model_dir: Path, **overrides: Any) -> Any:
    """An in-process LLMEngine with the servers' settings (engine-level tests)."""
    from densa.engine.llm_engine import LLMEngine

    return LLMEngine.from_args(engine_args(model_dir, **overrides))


def engine_client(
    model_dir: Path,
    client_class: type[EngineClient] = EngineClient,
    options: ClientOptions | None = None,
    **overrides: Any,
) -> EngineClient:
    """A client for an engine core in its own process, with debug controls (step delays)."""
    launcher = ProcessLauncher(asdict(engine_args(model_dir, **overrides)), debug_controls=True,
                               log_level="warning")  # fmt: skip
    return client_class(launcher, options or ClientOptions())


@dataclass
class RunningServer:
    base_url: str
    app: FastAPI
    engine: EngineClient

    def client(self, api_key: str = "test-key", **kwargs: Any) -> openai.OpenAI:
        # No retries: a test that expects 429 or 500 must see the first answer.
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, **kwargs
        )

    @property
    def tokenizer(self) -> Tokenizer:
        tokenizer = self.app.state.densa.tokenizer
        assert tokenizer is not None
        return tokenizer

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Wait until no request is in flight, every response is counted and logged, and the
        engine reports every KV page free (its stats arrive with each step and heartbeat)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.engine.stats
            if (
                self.engine.num_in_flight == 0
                # a client can hold its whole answer before the server has counted and logged it
                and self.app.state.densa.num_open_responses == 0
                and stats.num_unfinished == 0
                and stats.num_free_kv_pages == stats.num_kv_pages
            ):
                return
            time.sleep(0.02)
        stats = self.engine.stats
        raise AssertionError(
            f"not idle after {timeout} s: {self.engine.num_in_flight} in flight, "
            f"{stats.num_unfinished} in the engine, {stats.num_free_kv_pages}/"
            f"{stats.num_kv_pages} pages free"
        )

    def set_step_delay(self, seconds: float) -> None:
        """Make every engine step take `seconds` more (the engine core honours it in tests)."""
        future = asyncio.run_coroutine_threadsafe(self.engine.set_step_delay(seconds), self.loop)
        future.result(10)
        # The delay applies from the engine's next message poll: let it arrive.
        time.sleep(0.2)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        loop = self.app.state.densa_loop
        assert isinstance(loop, asyncio.AbstractEventLoop)
        return loop


class ScriptedClient(EngineClient):
    """An EngineClient that records each request and can be told to misbehave."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[dict[str, Any]] = []
        self.fail_after: int | None = None  # end the request with an engine error after N outputs
        self.refuse_with: Exception | None = None  # raise this instead of running the request

    async def generate(self, request: AddRequest) -> AsyncGenerator[RequestDelta, None]:
        call = {"request_id": request.request_id, "cache_scope": request.cache_scope}
        self.calls.append({**call, "session_id": request.session_id})
        if self.refuse_with is not None:
            raise self.refuse_with
        async with contextlib.aclosing(super().generate(request)) as deltas:
            num_seen = 0
            async for delta in deltas:
                if num_seen == self.fail_after:
                    yield _integrity_failure(delta)
                    return
                yield delta
                num_seen += 1


def _integrity_failure(delta: RequestDelta) -> RequestDelta:
    return RequestDelta(
        request_id=delta.request_id,
        new_token_ids=[],
        finished=True,
        finish_reason="error",
        error="kv_integrity_violation: page 3 was reallocated under this request",
        error_code="kv_integrity_violation",
        num_prompt_tokens=delta.num_prompt_tokens,
    )


@contextlib.contextmanager
def running_server(engine: EngineClient, **app_options: Any) -> Iterator[RunningServer]:
    """Serve `engine` (started by the app's lifespan) until the block ends."""
    app = build_app(engine, **app_options)
    _remember_loop(app)
    with serve_in_thread(app) as base_url:
        yield RunningServer(base_url, app, engine)


def _remember_loop(app: FastAPI) -> None:
    """Keep the server's event loop on the app, so tests can run client calls on it."""
    original = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app_: FastAPI) -> Any:
        app.state.densa_loop = asyncio.get_running_loop()
        async with original(app_) as state:
            yield state

    app.router.lifespan_context = lifespan
