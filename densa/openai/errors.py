"""OpenAI-style errors: one exception type, its JSON body, and the handlers that install it.

Every failure a client can cause becomes `{"error": {"message", "type", "param", "code"}}` with a
4xx status, so a bad request never takes the server down and never gets FastAPI's default 422 shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from densa.text.output import RequestOutput
from densa.utils.logging import get_logger

logger = get_logger(__name__)

# A status nginx made common for "the client closed the connection"; nobody reads the response.
STATUS_CLIENT_CLOSED = 499
# Error codes the engine reports that mean the request itself was bad, not the server.
_CLIENT_ERROR_CODES = {"invalid_request", "invalid_grammar"}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """A failure to report to the client as an OpenAI error body with an HTTP status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        error_type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        # Messages may quote what the client sent (a field name, a model id): never let that
        # make the error itself unencodable.
        message, param = _encodable(message), None if param is None else _encodable(param)
        self.info = ErrorInfo(message=message, type=error_type, param=param, code=code)
        self.headers = headers

    def to_response(self) -> JSONResponse:
        body = ErrorResponse(error=self.info).model_dump()
        return JSONResponse(body, status_code=self.status_code, headers=self.headers)


def _encodable(text: str) -> str:
    """Lone surrogates spelled out as `\\udXXX`, so the text can always be sent as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ClientDisconnected(Exception):
    """The client went away before the response was ready; its engine request is already aborted."""


# ---- constructors for the common cases ---------------------------------------------------------
def bad_request(message: str, code: str = "invalid_value", param: str | None = None) -> APIError:
    return APIError(400, message, code=code, param=param)


def model_not_found(model: str, served_model_names: Sequence[str]) -> APIError:
    served = ", ".join(repr(name) for name in served_model_names)
    message = f"the model {model!r} does not exist; this server serves {served}"
    return APIError(404, message, code="model_not_found", param="model")


def overloaded(detail: str) -> APIError:
    message = f"the server is overloaded ({detail}); retry after a short wait"
    return APIError(
        429, message, "rate_limit_exceeded", error_type="rate_limit_error", headers=_RETRY_SOON
    )


def shutting_down() -> APIError:
    message = "the server is shutting down and accepts no new requests; retry on another replica"
    return APIError(503, message, "server_shutting_down", error_type="server_error")


_RETRY_SOON = {"Retry-After": "1"}


def timed_out(timeout: float | None) -> APIError:
    limit = f"{timeout:g} s" if timeout is not None else "its deadline"
    message = (
        f"the request did not finish within {limit} (the server's --request-timeout) and was "
        "aborted; ask for fewer tokens, or retry when the server is less busy"
    )
    return APIError(504, message, "request_timeout", error_type="server_error")


def unauthorized(has_key: bool) -> APIError:
    if has_key:
        message = "incorrect API key provided; pass a key this server accepts"
    else:
        message = (
            "this server needs an API key: send the header 'Authorization: Bearer <key>' "
            "(or 'x-api-key: <key>')"
        )
    return APIError(401, message, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def engine_unavailable(detail: str) -> APIError:
    message = f"no engine is serving right now ({detail})"
    return APIError(
        503, message, "engine_unavailable", error_type="server_error", headers=_RETRY_SOON
    )


def from_engine_output(output: RequestOutput) -> APIError:
    """The error for a request the engine ended with finish_reason "error"."""
    code = output.error_code or "engine_error"
    message = output.error or "the engine failed this request"
    logger.warning("request %s ended with an error (%s): %s", output.request_id, code, message)
    if code in _CLIENT_ERROR_CODES:
        return APIError(400, message, code=code)
    if code == "engine_unavailable":  # the engine died under it: retrying may well work
        return APIError(503, message, code=code, error_type="server_error", headers=_RETRY_SOON)
    return APIError(500, message, code=code, error_type="server_error")


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """Name the offending field in both `param` and the message (the first three problems)."""
    errors = list(exc.errors())
    problems = [f"{_param(e['loc'])}: {_message(e)}" if e["loc"] else _message(e) for e in errors]
    first = errors[0] if errors else {"loc": (), "type": ""}
    code = _CODE_OF_ERROR_TYPE.get(str(first["type"]), "invalid_value")
    message = "; ".join(problems[:3]) or "invalid request"
    return bad_request(message, code=code, param=_param(first["loc"]) or None)


# pydantic error types with an OpenAI code of their own; every other problem is "invalid_value".
_CODE_OF_ERROR_TYPE = {
    "missing": "missing_required_parameter",
    "extra_forbidden": "unknown_parameter",
    "unsupported_parameter": "unsupported_parameter",
}


def _param(loc: Sequence[Any]) -> str:
    """("messages", 0, "role") -> "messages[0].role" (OpenAI's spelling of a nested field)."""
    parts = [p for p in loc if p != "body"]  # FastAPI prefixes body fields with "body"
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _message(error: Any) -> str:
    # A ValueError raised in a validator reads "Value error, <ours>"; the prefix adds nothing.
    if error["type"] == "value_error" and "error" in error.get("ctx", {}):
        return str(error["ctx"]["error"])
    if error["type"] == "extra_forbidden":
        return "unrecognized request argument (this server does not know this parameter)"
    return str(error["msg"])


# ---- handlers ------------------------------------------------------------------------------------
# Writes an error as the response the route's clients expect (OpenAI's shape unless the route
# speaks another API: see api_server.render_error).
ErrorRenderer = Callable[[Request, APIError], Response]


def openai_shape(_: Request, error: APIError) -> Response:
    return error.to_response()


# Remembers why a request failed (the server's request records); the router keeps no records.
ErrorNoter = Callable[[Request, str | None], None]


def _note_nothing(_: Request, __: str | None) -> None:
    pass


def install_error_handlers(
    app: FastAPI, render: ErrorRenderer = openai_shape, note_error: ErrorNoter = _note_nothing
) -> None:
    async def on_api_error(request: Request, exc: APIError) -> Response:
        note_error(request, exc.info.code)
        return render(request, exc)

    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        error = from_validation_error(exc)
        note_error(request, error.info.code)
        return render(request, error)

    async def on_http_exception(request: Request, exc: StarletteHTTPException) -> Response:
        # Unknown routes and wrong methods: same body shape as every other error.
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        headers = dict(exc.headers) if exc.headers else None
        return render(request, APIError(exc.status_code, str(exc.detail), code, headers=headers))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error serving %s %s", request.method, request.url.path)
        note_error(request, "internal_error")
        message = "internal server error; the server logged the details"
        return render(request, APIError(500, message, "internal_error", error_type="server_error"))

    app.add_exception_handler(APIError, on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnected, _on_client_disconnected)
    app.add_exception_handler(RequestValidationError, on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http_exception)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_unexpected)


async def _on_client_disconnected(_: Request, __: Exception) -> Response:
    return Response(status_code=STATUS_CLIENT_CLOSED)
