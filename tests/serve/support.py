"""Helpers for the server tests: a real uvicorn server on a free loopback port, on a thread."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi import FastAPI

from densa.engine.args import EngineArgs
from densa.engine.async_engine import AsyncEngine
from densa.engine.llm_engine import LLMEngine
from densa.engine.output import RequestOutput
from densa.sampling_params import SamplingParams
from densa.serve import build_app, serve_in_thread

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 512


@dataclass
class RunningServer:
    base_url: str
    app: FastAPI
    async_engine: AsyncEngine

    @property
    def engine(self) -> LLMEngine:
        return self.async_engine.engine

    def client(self, api_key: str = "test-key", **kwargs: Any) -> openai.OpenAI:
        # No retries: a test that expects 429 or 500 must see the first answer.
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, **kwargs
        )

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Wait until no request is in flight, every response is counted and logged, and every KV
        page is free (the engine thread owns the engine, so poll)."""
        kv = self.engine.kv_manager
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (
                self.async_engine.num_in_flight == 0
                # a client can hold its whole answer before the server has counted and logged it
                and self.app.state.densa.num_open_responses == 0
                and not self.engine.has_unfinished_requests()
                and kv.num_free_pages == kv.num_pages
            ):
                return
            time.sleep(0.02)
        raise AssertionError(
            f"not idle after {timeout} s: {self.async_engine.num_in_flight} in flight, "
            f"{kv.num_free_pages}/{kv.num_pages} pages free"
        )


class ScriptedEngine(AsyncEngine):
    """An AsyncEngine that records each generate() call and can be told to misbehave."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine, max_waiting_requests=0)  # with max_num_seqs=1: one in flight
        self.calls: list[dict[str, Any]] = []
        self.fail_after: int | None = None  # end the request with an engine error after N outputs
        self.refuse_with: Exception | None = None  # raise this from generate() instead of running

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_scope: str = "",
        session_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        self.calls.append(
            {"request_id": request_id, "cache_scope": cache_scope, "session_id": session_id}
        )
        if self.refuse_with is not None:
            raise self.refuse_with
        outputs = super().generate(prompt_token_ids, params, request_id, cache_scope, session_id)
        async with contextlib.aclosing(outputs):  # type: ignore[type-var]
            num_seen = 0
            async for output in outputs:
                if num_seen == self.fail_after:
                    yield _integrity_failure(output)
                    return
                yield output
                num_seen += 1


def _integrity_failure(output: RequestOutput) -> RequestOutput:
    return RequestOutput(
        request_id=output.request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="error",
        error="kv_integrity_violation: page 3 was reallocated under this request",
        error_code="kv_integrity_violation",
        num_prompt_tokens=output.num_prompt_tokens,
    )


SlowDown = Callable[[RunningServer], None]


def slow_down_steps(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make each engine step take 10 ms more, so a long request stays in flight for seconds."""
    step = server.engine.step

    def slow_step() -> list[RequestOutput]:
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(server.engine, "step", slow_step)


def make_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    settings: dict[str, Any] = {
        "served_model_name": MODEL_NAME,
        "kv_cache_memory": "64MiB",
        "max_model_len": MAX_MODEL_LEN,
    }
    settings.update(overrides)
    return LLMEngine.from_args(EngineArgs(model=str(model_dir), **settings))


@contextlib.contextmanager
def running_server(async_engine: AsyncEngine, **app_options: Any) -> Iterator[RunningServer]:
    async_engine.start()
    app = build_app(async_engine, MODEL_NAME, **app_options)
    try:
        with serve_in_thread(app) as base_url:
            yield RunningServer(base_url, app, async_engine)
    finally:
        asyncio.run(async_engine.shutdown(drain_timeout=1.0))
