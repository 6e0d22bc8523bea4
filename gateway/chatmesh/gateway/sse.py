"""The SSE relay: one gRPC turn stream (SendTurn, AttachTurn or RegenerateTurn) -> one text/event-stream response.

How it works. `open_relay` starts the gRPC call and awaits its FIRST event before any HTTP header is sent, so an
error the chat service raises up front (unknown conversation, reused turn id, bad argument) is still answered as
a JSON error with its proper status. Then `TurnRelay` (a raw ASGI response) runs two tasks per stream:

- the pump: the one turn-stream reader (`chatmesh.gateway.relay.Relay`: sanitising, reply events, the started
  and final bookkeeping metering settles by) writing each framed event with `send`, awaited, so a slow client
  back-pressures the gRPC stream instead of growing a buffer; a final event ends the stream;
- the watcher awaits the client's `http.disconnect` and, while the model is silent for `heartbeat_s`, writes an
  SSE comment so proxies and browsers keep the connection open.

Whichever ends first ends the other. On disconnect the gRPC call is cancelled, which cancels the turn in the chat
service (I5: the partial reply is stored as stopped), except when this relay wrote none of the reply's text to
its client (the stream was cut at the response headers, the SDK's retry is coming): then the relay of the
stream a new turn is generated for (its `turn.started` not a replay) first asks chat to release the turn (`release`: StopTurn with release), so nothing is stored for it and the
retry generates it (or, if the retry is already following it, it goes on for that retry) instead of replaying an
empty stopped reply. Each ASGI `send` writes one whole frame, so the two tasks never interleave bytes. On gateway
shutdown `Relays.drain` gives open streams `grace_s` to finish, then ends them the same way.

Framing: what each event becomes on the wire is a `relay.Framing` (chatmesh's own `turn.*` events by default; the
OpenAI-compatible surface passes its own, `chat.completion.chunk` or `response.*` events), so both surfaces share
one relay, its back-pressure, disconnect handling, heartbeats, drain and metering (and a non-streaming OpenAI
reply is collected by the same `relay.Relay`).

Resume: the SSE id is the TurnEvent sequence. The sanitiser may hold back the start of a Markdown construct (a `[`
that could open a link) at the end of a delta; a client that reconnects right there loses that held text, never
receives an unsanitised image or link.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import grpc
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from chatmesh.gateway import events
from chatmesh.gateway.errors import ApiError, http_for_grpc
from chatmesh.gateway.relay import STREAM_MESSAGES, Framing, OnEnd, OnStarted, Relay, TurnCall, noop_started
from chatmesh.gateway.sanitise import Sanitiser
from chatmesh.gateway.observe import START_KEY
from chatmesh.mesh import logs, metrics
from chatmesh.mesh.errors import PROMPT_TOKENS_TRAILER
from chatmesh.v1 import chat_pb2

log = logs.get("chatmesh.gateway.sse")

# Headers that stop proxies (nginx's X-Accel-Buffering) and intermediaries (no-transform) from buffering or
# compressing the stream, and browsers from caching it.
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache, no-store, no-transform"),
    (b"x-accel-buffering", b"no"),
]


__all__ = ["ChatmeshFraming", "Framing", "OnEnd", "OnStarted", "PromptOverAllowance", "Relays", "Release",
           "TurnCall", "TurnRelay", "first_event", "next_event", "open_relay"]

Release = Callable[[], Awaitable[object]]  # asks chat to release the relay's turn (its client saw none of it)
RELEASE_TIMEOUT_S = 2.0


class PromptOverAllowance(ApiError):
    """Chat refused the turn's prompt as larger than its allowance (RESOURCE_EXHAUSTED with the
    `chatmesh-prompt-tokens` trailer); the edge turns it into the limit's answer (chatmesh.gateway.metering)."""

    def __init__(self, prompt_tokens: int, message: str) -> None:
        super().__init__(429, "rate_limited", message)
        self.prompt_tokens = prompt_tokens


def _prompt_tokens_trailer(err: grpc.aio.AioRpcError) -> int | None:
    # grpc.aio hands a Metadata of (key, value) pairs (its stubs claim objects with .key and .value)
    metadata: Any = err.trailing_metadata()
    for key, value in metadata or ():
        if key == PROMPT_TOKENS_TRAILER:
            text = value.decode() if isinstance(value, bytes) else str(value)
            return int(text) if text.isdigit() else None
    return None


class ChatmeshFraming:
    """chatmesh's own events: `id: <sequence>`, `event: turn.<kind>`, `data: <JSON>` (chatmesh.gateway.events).
    `turn.completed` also carries `ttft_ms`, the time to first text as this edge saw it (the web page shows it)."""

    def __init__(self) -> None:
        self.ttft_s: float | None = None  # set by the relay when it writes the first text

    def delta(self, sequence: int, text: str) -> bytes:
        return events.delta_frame(sequence, text)

    async def event(self, event: events.ReplyEvent) -> bytes:
        data = events.data_of(event)
        if isinstance(event, events.ReplyCompleted) and self.ttft_s is not None:
            data["ttft_ms"] = round(self.ttft_s * 1000, 1)
        return events.frame(event.sequence, event.kind, data)

    def failed(self, sequence: int, message: str, retryable: bool) -> bytes:
        return events.failed_frame(sequence, message, retryable)

    async def end(self, outcome: events.Outcome) -> bytes:
        return b""


class Open(Protocol):
    """Something streaming a turn that shutdown ends: a relay, or a turn followed for nobody in particular (the
    OpenAI surface's background responses)."""

    def end(self) -> None: ...


class Relays:
    """The open relays of one gateway process, so shutdown can end them."""

    def __init__(self) -> None:
        self.open: set[Open] = set()

    async def drain(self, grace_s: float) -> None:
        deadline = asyncio.get_running_loop().time() + grace_s
        while self.open and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for relay in list(self.open):
            relay.end()


async def first_event(call: TurnCall) -> chat_pb2.TurnEvent:
    """Awaits the first event of `call`; a gRPC error before it is raised as an ApiError (nothing was sent)."""
    try:
        first: object = await call.read()
    except grpc.aio.AioRpcError as err:
        if err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and (size := _prompt_tokens_trailer(err)) is not None:
            raise PromptOverAllowance(size, err.details() or "prompt over its allowance") from None
        raise ApiError.from_rpc(err) from None
    if not isinstance(first, STREAM_MESSAGES):
        raise ApiError(503, "unavailable", "the chat service ended the turn stream without an event")
    return first.event


async def next_event(call: TurnCall) -> chat_pb2.TurnEvent | None:
    """The next event of a turn stream, None when it ended without one (gRPC errors propagate)."""
    message: object = await call.read()
    return message.event if isinstance(message, STREAM_MESSAGES) else None


async def open_relay(call: TurnCall, *, sanitiser: Sanitiser, heartbeat_s: float, relays: Relays,
                     on_end: OnEnd, on_started: OnStarted = noop_started,
                     ttft: metrics.HistogramChild | None = None, release: Release | None = None) -> TurnRelay:
    """Awaits the first event of `call` (see `first_event`), then relays the stream in chatmesh's own events."""
    return TurnRelay(Relay(call, await first_event(call), sanitiser, on_started, on_end), heartbeat_s, relays,
                     ttft=ttft, release=release)


class TurnRelay(Response):
    """A raw ASGI response relaying one turn stream; see the module docstring. (A Response subclass only so
    routes can return it; it writes its own headers and body.)"""

    def __init__(self, relay: Relay, heartbeat_s: float, relays: Relays, framing: Framing | None = None,
                 ttft: metrics.HistogramChild | None = None, release: Release | None = None):
        super().__init__(status_code=200, media_type="text/event-stream")
        self._release = release  # a new turn's: asked when its client goes having been shown no text
        self._ending = False  # `end()` was called
        self._framing: Framing = framing or ChatmeshFraming()
        self._ttft = ttft  # where a new turn's time to first text is observed (None: not measured, an attach)
        self._arrived = time.perf_counter()  # replaced by the request's arrival time (observe.Observe) when known
        self._ttft_s: float | None = None
        self._relay = relay
        self._heartbeat_s = heartbeat_s
        self._relays = relays
        self._last_send = 0.0
        self._tasks: list[asyncio.Task[None]] = []

    def end(self) -> None:
        """Ends the stream (shutdown, past the grace) as its client going away would: a turn it showed none of
        is released first, any other stopped where its client was."""
        self._ending = True
        if self._tasks:
            self._tasks[1].cancel()  # the watcher: the pump goes on until the release, if any, is sent

    def _stop_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._relays.open.add(self)
        self._arrived = scope.get(START_KEY, self._arrived)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            self._last_send = asyncio.get_running_loop().time()
            self._tasks = [asyncio.create_task(self._pump(send)), asyncio.create_task(self._watch(receive, send))]
            if self._ending:
                self._tasks[1].cancel()
            await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            if self._relay.final_written and not self._tasks[1].done():  # the client is still there
                closing = await self._framing.end(self._relay.outcome)
                if closing:
                    await self._write(send, closing)
        except OSError:  # the client went away before the headers were written
            pass
        finally:
            self._relays.open.discard(self)
            cut = not self._relay.final_written and not (self._tasks and self._tasks[0].done())  # still runs
            # a retry's attach or a replay has no turn of its own to release
            if cut and self._ttft_s is None and self._release is not None and self._relay.generates:
                await self._released()  # before the pump is ended: cancelling its read cancels the call
            self._stop_tasks()
            self._relay.call.cancel()  # no-op once the stream finished; otherwise cancels the turn (client gone)
            await asyncio.gather(*self._tasks, return_exceptions=True)
            try:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                pass
            await self._relay.finish()

    async def _released(self) -> None:
        """Asks chat to release the turn before the call is cancelled (module header); a failure leaves the
        cancel to stop it, as before."""
        assert self._release is not None
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                await self._release()
        except (TimeoutError, grpc.aio.AioRpcError) as err:
            log.info("turn_release_failed", error=type(err).__name__)

    def _first_text(self) -> None:
        self._ttft_s = time.perf_counter() - self._arrived
        if self._ttft is not None:
            self._ttft.observe(self._ttft_s)
        if isinstance(self._framing, ChatmeshFraming):
            self._framing.ttft_s = self._ttft_s

    async def _write(self, send: Send, chunk: bytes) -> None:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        self._last_send = asyncio.get_running_loop().time()

    async def _pump(self, send: Send) -> None:
        async def write(chunk: bytes) -> None:
            await self._write(send, chunk)

        def on_text() -> None:
            if self._ttft_s is None:
                self._first_text()

        try:
            await self._relay.pump(self._framing, write, on_text)
        except grpc.aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.CANCELLED:
                return
            mapped = http_for_grpc(err.code())
            log.warning("turn_stream_failed", grpc_code=err.code().name)
            try:
                await self._write(send, self._framing.failed(self._relay.last_sequence, err.details() or mapped.code,
                                                             mapped.status == 503))
            except OSError:
                pass
        except OSError:  # the client went away mid-write: the watcher sees the disconnect too
            pass

    async def _watch(self, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow the cancellation `end()`
                # sends when it races a message that is already there, and the relay then never finishes.
                async with asyncio.timeout(self._heartbeat_s):
                    message = await receive()
            except TimeoutError:
                if loop.time() - self._last_send >= self._heartbeat_s * 0.9:
                    try:
                        await self._write(send, events.HEARTBEAT)
                    except OSError:
                        return
                continue
            if message["type"] == "http.disconnect":
                return
