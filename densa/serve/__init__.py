"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncEngine.

protocol    request / response bodies (pydantic), validated field by field
errors      OpenAI-style error bodies and the exception handlers
responses   engine outputs -> response bodies, stream chunks and logprobs
generation  one request on the engine: start, gather whole, or stream as SSE
api_server  routes, request preparation, `build_app` and `run_server`
"""

from densa.serve.api_server import build_app, run_server

__all__ = ["build_app", "run_server"]
