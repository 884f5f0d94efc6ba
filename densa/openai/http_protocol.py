"""uvicorn's HTTP/1.1 protocol with a deadline on the request headers (slow-client protection).

uvicorn times out idle keep-alive connections, but a client that connects and then sends its
headers a byte at a time (or never) holds a connection and its buffers open indefinitely. Here
every request's headers must arrive within `header_timeout` seconds of its first byte (or of the
connection opening); otherwise the server answers 408 and closes. Bodies have their own deadline
in the app (serve/prepare.read_json), where the request is known.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT = 10.0  # seconds

_TIMEOUT_BODY = (
    b'{"error": {"message": "the request headers did not arrive in time; send them at once", '
    b'"type": "invalid_request_error", "param": null, "code": "request_header_timeout"}}'
)
_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY)
)


def with_header_timeout(timeout: float) -> type[H11Protocol]:
    """A protocol class for `uvicorn.Config(http=...)` enforcing `timeout` on request headers."""
    return type("HeaderTimeoutH11Protocol", (_HeaderTimeoutProtocol,), {"header_timeout": timeout})


class _HeaderTimeoutProtocol(H11Protocol):
    header_timeout = DEFAULT_HEADER_TIMEOUT
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._is_between_requests():
            self._arm_header_timer()  # the first bytes of a new request on a kept-alive connection
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # the headers are complete: a new request cycle began
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _is_between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._is_between_requests():
            return
        # h11 cannot send a response to a request it has not parsed: write it by hand.
        self.transport.write(_REQUEST_TIMEOUT)
        self.transport.close()
