"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): the front. It reaches the engine core
(its own process by default) only through `engine_client` and the typed messages of `densa.ipc`,
and never imports torch.

protocol    request / response bodies (pydantic), validated field by field
fields      annotated request field types: what each accepts and how it is published
errors      OpenAI-style error bodies and the exception handlers
prepare     HTTP request -> engine call: body, prompt tokens, context length, cache scope
responses   engine outputs -> response bodies, stream chunks and logprobs
engine_client  the engine core's handle: messages over ZeroMQ, liveness, restarts
generation  one request on the engine: text from token deltas, whole or as SSE; deadlines
auth        optional API keys
tracking    one record per request: structured log line, x-request-id
metrics     GET /metrics (Prometheus), per-app registry
peer        GET /densa/info and /densa/load: what a router needs (tokenizer, page size, load)
api_server  routes, `build_app`, the published OpenAPI schema
process     `run_server` (signals, graceful drain) and `serve_in_thread` (tests, benchmarks)
tools/      tool calls and structured output: models, formats, parser, prompts, schema checks
unknown_fields  request fields the server does not know: dropped, warned about, named in a header
reasoning   a reasoning model's answer -> reasoning_content and content (--reasoning-parser)
templates   what a chat request adds to the chat template (chat_template_kwargs, reasoning_effort)
tokenize    POST /tokenize and /detokenize (vLLM's shapes), answered by the front alone
choices     n > 1: one engine request per choice, the later ones reusing the first's prompt pages
"""

from densa.serve.api_server import build_app
from densa.serve.process import run_server, serve_in_thread

__all__ = ["build_app", "run_server", "serve_in_thread"]
