"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): the front. It reaches the engine core
(its own process by default) only through `densa.engine.client` and the typed messages of
`densa.ipc`, and never imports torch. The API's shapes (bodies, errors, preparation, tool calls,
formatters) are in `densa.openai`; here are the app, its routes and the engine hookup.

api_server  `build_app`: the app, its middleware and error rendering
state       what the routes share (`ServerState`, `ApiOptions`)
routes/     one module per API: open (health, metrics), openai, messages, responses, tokenize
pipeline    what every generation route does: key, body, engine call, whole or streamed answer
openapi     the published OpenAPI schema
generation  one request on the engine: text from token deltas, whole or as SSE; deadlines
choices     n > 1: one engine request per choice, the later ones reusing the first's prompt pages
auth        optional API keys
tracking    one record per request: structured log line, x-request-id
metrics     GET /metrics (Prometheus), per-app registry
peer        GET /densa/info and /densa/load: what a router needs (tokenizer, page size, load)
tokenize    /tokenize and /detokenize (vLLM's shapes), answered by the front alone
disagg      prefill/decode placement: which prefill worker a decode request reads its KV from
process     `run_server` (signals, graceful drain) and `serve_in_thread` (tests, benchmarks)
scrape      reading a /metrics page back (benchmarks)
"""

from densa.serve.api_server import build_app
from densa.serve.process import run_server, serve_in_thread

__all__ = ["build_app", "run_server", "serve_in_thread"]
