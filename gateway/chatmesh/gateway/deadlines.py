"""Deadlines at the edge, so slow and idle connections cannot hold the gateway's sockets and memory.

A slow-loris client opens connections and sends its headers or body a byte at a time, or nothing at all; each
held connection costs a socket, a protocol object and, mid-body, a buffer. Three bounds, each a setting:

- headers (CHATMESH_EDGE_HEADER_TIMEOUT_S, 10 s): a request's headers must be complete this long after the
  connection opened or, on a kept-alive connection, after the request's first byte. Otherwise the connection is
  answered `408` (if anything arrived) and closed. A fresh connection that sends nothing is closed at the same
  deadline. This is a deadline, not a per-read timeout: a byte every second does not extend it.
- body (CHATMESH_EDGE_BODY_TIMEOUT_S, 30 s): the whole body must have arrived this long after the headers; else
  the request is answered `408` with `connection: close`. (30 s carries the largest accepted body at ~200 KB/s.)
- idle (CHATMESH_EDGE_IDLE_TIMEOUT_S, 5 s): a kept-alive connection with no request in flight is closed after
  this long (the servers' keep-alive timeout).

An open SSE stream is a response in progress, so none of these end it; its disconnect handling is the relay's.

Where each lives: the body deadline is ASGI middleware (`BodyDeadline`), the same for both servers; the idle
bound is each server's keep-alive setting; the header deadline is `edge_protocol()`, uvicorn's httptools
protocol with a timer (uvicorn has no header timeout of its own). On hypercorn both the header and the idle
bound are its idle timer (`keep_alive_timeout`, set to the smaller of the two), which runs from a connection's
start, and each response's end, until a request's headers are complete: a deadline too, but the connection is
closed without a 408. (hypercorn's `read_timeout` is not used: it bounds every read, so it cut SSE streams whose
client sent nothing for that long.)
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from chatmesh.gateway.errors import ApiError

_TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class BodyTimeout(ApiError):
    """The request body did not arrive within the body deadline."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, "request_timeout", f"the request body did not arrive within {timeout_s:g} s")


class BodyDeadline:
    """ASGI middleware: the request body must be complete `timeout_s` after the request started; a `receive`
    past that raises `BodyTimeout` (answered 408, and the connection closed). Once the body is in, `receive`
    passes straight through (an SSE relay waits on it for the disconnect)."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for runs its awaitable as another task and
                # can swallow a cancellation that races an immediate result (the relay's watcher then hangs).
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout(self.timeout_s) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, timed_receive, send)


def edge_protocol(header_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the header deadline of the module header."""

    class EdgeHttpProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _request_bytes = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            idle = self.cycle is None or self.cycle.response_complete
            if idle and self._header_timer is None:
                self._arm()  # a new request starts on a kept-alive connection
            if idle:
                self._request_bytes = True
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._disarm()
            self._request_bytes = False
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expired(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self._request_bytes:
                self.transport.write(_TIMEOUT_408)
            self.transport.close()

    return EdgeHttpProtocol


def uvicorn_options(header_timeout_s: float, idle_timeout_s: float) -> dict[str, Any]:
    """The uvicorn.Config arguments that apply the header and idle bounds."""
    return {"http": edge_protocol(header_timeout_s), "timeout_keep_alive": max(1, round(idle_timeout_s))}
