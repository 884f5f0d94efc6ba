"""A fake densa worker for the router's HTTP tests: the peer endpoints and a chat route whose
behaviour a test sets (answer, stream, refuse with 429/503, die mid-stream), recording what it
received."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from densa.ipc.messages import TokenizerFiles


@dataclass
class FakeWorker:
    tokenizer: TokenizerFiles
    mode: str = "ok"  # ok | 429 | 503 | 400 | die_mid_stream | endless
    num_streams_closed: int = 0  # streams whose generator ended (finished, failed or cancelled)
    num_chunks_sent: int = 0
    num_free_kv_pages: int = 100
    num_running: int = 0
    load_status: int = 200  # else /densa/load answers this status with a hostile error text
    set_cookie: str | None = None  # a Set-Cookie header on every answer to a chat request
    answer_headers: dict[str, str] = field(default_factory=dict)  # more headers on chat answers
    received: list[dict[str, Any]] = field(default_factory=list)  # headers + body per request
    paths: list[str] = field(default_factory=list)  # GET paths asked (models, metrics), decoded

    def app(self) -> FastAPI:
        app = FastAPI()
        app.add_api_route("/densa/load", self._load, methods=["GET"])
        app.add_api_route("/densa/info", self._info, methods=["GET"])
        app.add_api_route("/v1/chat/completions", self._chat, methods=["POST"])
        app.add_api_route("/v1/models", self._models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self._models, methods=["GET"])
        app.add_api_route("/metrics", self._models, methods=["GET"])
        return app

    async def _models(self, request: Request) -> Response:
        self.paths.append(request.scope["path"])
        if request.scope["path"] == "/metrics":
            return Response(b"densa_worker_secret_metric 1\n", media_type="text/plain")
        model_id = request.path_params.get("model_id")
        if model_id is None:
            return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        if model_id != "tiny":
            return JSONResponse({"error": {"message": f"no model {model_id!r}"}}, status_code=404)
        return JSONResponse({"id": "tiny", "object": "model"})

    async def _load(self) -> Response:
        if self.load_status != 200:
            text = b'kv_peer_mismatch: evil"} 1\ninjected_metric{x="'
            return Response(text, status_code=self.load_status)
        return JSONResponse({"num_running": self.num_running, "num_waiting": 0,
                             "num_in_flight": self.num_running, "num_kv_pages": 100,
                             "num_free_kv_pages": self.num_free_kv_pages, "page_size": 16,
                             "engine_pid": 1})  # fmt: skip

    async def _info(self) -> Response:
        files = {"tokenizer_json": self.tokenizer.tokenizer_json,
                 "config_json": self.tokenizer.config_json,
                 "chat_template": self.tokenizer.chat_template}  # fmt: skip
        return JSONResponse({"model": "tiny", "max_model_len": 512, "page_size": 16,
                             "num_kv_pages": 100, "max_num_seqs": 8, "eos_token_ids": [2],
                             "tool_call_format": "hermes", "engine_pid": 1,
                             "tokenizer": files})  # fmt: skip

    async def _chat(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.received.append({"headers": dict(request.headers), "body": body})
        if self.mode == "429":
            error = {"error": {"message": "too busy", "type": "rate_limit", "code": "overloaded"}}
            return JSONResponse(error, status_code=429, headers={"Retry-After": "7"})
        if self.mode == "503":
            return JSONResponse({"error": {"message": "restarting"}}, status_code=503)
        if self.mode == "400":
            return Response(b'{"error": {"message": "exactly these bytes"}}', status_code=400,
                            media_type="application/json")  # fmt: skip
        headers = dict(self.answer_headers)
        if self.set_cookie:
            headers["set-cookie"] = self.set_cookie
        if body.get("stream"):
            return StreamingResponse(
                self._events(), media_type="text/event-stream", headers=headers
            )
        return JSONResponse(_completion("hello", 3), headers=headers)

    async def _events(self) -> AsyncIterator[bytes]:
        try:
            for i in range(100_000 if self.mode == "endless" else 4):
                if self.mode == "die_mid_stream" and i == 2:
                    raise RuntimeError("the worker dies mid-stream")
                chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0,
                         "model": "tiny", "choices": [{"index": 0, "finish_reason": None,
                                                       "delta": {"content": f"t{i} "}}]}  # fmt: skip
                yield f"data: {json.dumps(chunk)}\n\n".encode()
                self.num_chunks_sent += 1
                await asyncio.sleep(0.01)
            yield b"data: [DONE]\n\n"
        finally:
            self.num_streams_closed += 1


def _completion(text: str, num_tokens: int) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "tiny",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": num_tokens,
                      "total_tokens": 5 + num_tokens}}  # fmt: skip
