"""A fake OpenAI-compatible completion server for the peer benchmark's tests: streams N events of
known text at known delays, reports usage, and says which engine-specific fields it received.

python fake_openai_server.py --port P [--token-delay S] [--first-delay S] [--tokens-per-event K]
    [--short-by N] [--no-usage] [--draft-timings DRAFTED,ACCEPTED]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def build_app(ns: argparse.Namespace) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        tokens = int(body["max_tokens"]) - ns.short_by
        # The benchmark's extra_body arrives as top-level fields: echo that it did.
        marker = "forced" if body.get("ignore_eos") else "plain"

        async def events():  # type: ignore[no-untyped-def]
            await asyncio.sleep(ns.first_delay)
            sent = 0
            while sent < tokens:
                count = min(ns.tokens_per_event, tokens - sent)
                chunk = {"choices": [{"index": 0, "text": f" {marker}" * count}]}
                yield f"data: {json.dumps(chunk)}\n\n"
                sent += count
                await asyncio.sleep(ns.token_delay * count)
            usage = (
                None
                if ns.no_usage
                else {
                    "prompt_tokens": len(str(body["prompt"]).split()),
                    "completion_tokens": tokens,
                    "total_tokens": tokens,
                }
            )
            final = {
                "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                "usage": usage,
                "created": int(time.time()),
            }
            if ns.draft_timings:  # llama-server's draft counters, in its last event
                drafted, accepted = (int(v) for v in ns.draft_timings.split(","))
                final["timings"] = {"draft_n": drafted, "draft_n_accepted": accepted}
            yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-delay", type=float, default=0.002)
    parser.add_argument("--first-delay", type=float, default=0.01)
    parser.add_argument("--tokens-per-event", type=int, default=1)
    parser.add_argument("--short-by", type=int, default=0, help="send this many tokens too few")
    parser.add_argument("--no-usage", action="store_true")
    parser.add_argument("--draft-timings", default=None, help="DRAFTED,ACCEPTED per request")
    ns = parser.parse_args()
    uvicorn.run(build_app(ns), host="127.0.0.1", port=ns.port, log_level="warning")


if __name__ == "__main__":
    main()
