"""A no-op mesh of chatmesh's shape: what the hops on a turn's path cost with no work behind them.

Same processes, transports and call shapes as the real mesh on the way to a turn's first token, every handler
answering at once with a few bytes (no database, no classifier, no engine):

    client --HTTP POST, SSE--> "gateway" (Starlette on uvicorn, like chatmesh's edge)
        --server-streaming gRPC--> "chat", which, like chatmesh's ChatCore:
            claim (unary, "store") | pick (unary, "router") | input check (unary, "moderation")   in parallel
            -> Generate (server-streaming, "engine": a started message, then a delta)
            -> the delta's output check (one message each way on a long-lived bidirectional stream, "moderation")
            -> relays the delta; then finish (unary, "store") and release (unary, "router") after the stream

Each service is its own process (grpc.aio servers with generic byte handlers, so no protos), started by
`FloorMesh`. bench/mesh_overhead.py drives it in the same run as the real mesh and the direct engine calls: the
floor's TTFT minus the direct call's is what gRPC + HTTP hops alone add on this machine, the real mesh's minus
the floor's is what chatmesh's own work adds.

    .venv/bin/python -m bench.mesh_floor serve <role> <port> [<peer ports...>]   (FloorMesh runs these)
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

ROLES = ("store", "router", "moderation", "engine", "chat", "gateway")


def _ident(b: bytes) -> bytes:
    return b


def _method(name: str) -> str:
    return f"/floor.Floor/{name}"


async def _grpc_server(port: int, handlers: dict[str, grpc.RpcMethodHandler[bytes, bytes]]) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Floor", handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _unary(request: bytes, context: Any) -> bytes:
    return b"ok:" + request[:16]


async def _generate(request: bytes, context: Any) -> AsyncIterator[bytes]:
    yield b"started"
    await asyncio.sleep(0)
    yield b"delta:Hello"
    yield b"finished"


async def _check_stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for req in requests:
        yield req[:8] + b"pass"


def _plain(fn: Any, kind: str) -> grpc.RpcMethodHandler[bytes, bytes]:
    make = {"uu": grpc.unary_unary_rpc_method_handler, "us": grpc.unary_stream_rpc_method_handler,
            "ss": grpc.stream_stream_rpc_method_handler}[kind]
    handler: grpc.RpcMethodHandler[bytes, bytes] = make(fn, request_deserializer=_ident, response_serializer=_ident)
    return handler


class _CheckMux:
    """One long-lived bidirectional stream shared by every turn (as chatmesh's moderation client does): each
    check is one message out and one back, matched by an 8-byte id."""

    def __init__(self, channel: grpc.aio.Channel):
        self._queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._waiting: dict[bytes, asyncio.Future[bytes]] = {}
        self._ids = itertools.count()
        call = channel.stream_stream(_method("CheckOutput"), request_serializer=_ident,
                                     response_deserializer=_ident)(self._requests())
        self._reader = asyncio.ensure_future(self._read(call))

    async def _requests(self) -> AsyncIterator[bytes]:
        while True:
            yield await self._queue.get()

    async def _read(self, call: Any) -> None:
        async for resp in call:
            fut = self._waiting.pop(resp[:8], None)
            if fut is not None and not fut.done():
                fut.set_result(resp)

    async def check(self, text: bytes) -> bytes:
        key = next(self._ids).to_bytes(8, "big")
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiting[key] = fut
        await self._queue.put(key + text)
        return await fut


async def _chat(port: int, store: int, router: int, moderation: int, engine: int) -> None:
    def chan(p: int) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(f"127.0.0.1:{p}")

    store_ch, router_ch, mod_ch, engine_ch = chan(store), chan(router), chan(moderation), chan(engine)
    claim = store_ch.unary_unary(_method("Unary"), request_serializer=_ident, response_deserializer=_ident)
    pick = router_ch.unary_unary(_method("Unary"), request_serializer=_ident, response_deserializer=_ident)
    check_input = mod_ch.unary_unary(_method("Unary"), request_serializer=_ident, response_deserializer=_ident)
    generate = engine_ch.unary_stream(_method("Generate"), request_serializer=_ident, response_deserializer=_ident)
    mux: _CheckMux | None = None

    async def send_turn(request: bytes, context: Any) -> AsyncIterator[bytes]:
        nonlocal mux
        if mux is None:
            mux = _CheckMux(mod_ch)
        await asyncio.gather(claim(request), pick(request), check_input(request))
        yield b"started"
        async for resp in generate(request):
            if resp.startswith(b"delta:"):
                await mux.check(resp[6:])
                yield resp
        await asyncio.gather(claim(b"finish"), pick(b"release"))
        yield b"done"

    await _grpc_server(port, {"SendTurn": _plain(send_turn, "us")})


def _gateway(port: int, chat: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    state: dict[str, Any] = {}

    async def turn(request: Request) -> StreamingResponse:
        body = await request.body()
        if "call" not in state:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{chat}")
            state["call"] = channel.unary_stream(_method("SendTurn"), request_serializer=_ident,
                                                 response_deserializer=_ident)

        async def events() -> AsyncIterator[bytes]:
            async for msg in state["call"](body):
                if msg.startswith(b"delta:"):
                    yield b"event: turn.delta\ndata: " + msg[6:] + b"\n\n"
                elif msg == b"done":
                    yield b"event: turn.done\ndata: {}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/turn", turn, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_config=None, access_log=False, server_header=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FloorMesh:
    """The no-op mesh's six processes on free loopback ports."""

    def __init__(self) -> None:
        self.ports = {role: free_port() for role in ROLES}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

    @property
    def engine_address(self) -> str:
        return f"127.0.0.1:{self.ports['engine']}"

    def start(self, timeout_s: float = 30.0) -> None:
        p = self.ports
        peers = {"chat": [p["store"], p["router"], p["moderation"], p["engine"]], "gateway": [p["chat"]]}
        root = Path(__file__).resolve().parent.parent
        for role in ROLES:
            args = [sys.executable, "-m", "bench.mesh_floor", "serve", role, str(p[role]),
                    *map(str, peers.get(role, []))]
            self.procs[role] = subprocess.Popen(args, cwd=root, stdin=subprocess.DEVNULL,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        for role in ROLES:
            while True:
                if self.procs[role].poll() is not None:
                    self.stop()
                    raise RuntimeError(f"floor {role} exited with {self.procs[role].returncode}")
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", p[role])) == 0:
                        break
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"floor {role} did not listen within {timeout_s:.0f} s")
                time.sleep(0.05)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()


def _serve(role: str, port: int, peers: list[int]) -> None:
    match role:
        case "store" | "router":
            asyncio.run(_grpc_server(port, {"Unary": _plain(_unary, "uu")}))
        case "moderation":
            asyncio.run(_grpc_server(port, {"Unary": _plain(_unary, "uu"),
                                            "CheckOutput": _plain(_check_stream, "ss")}))
        case "engine":
            asyncio.run(_grpc_server(port, {"Generate": _plain(_generate, "us")}))
        case "chat":
            asyncio.run(_chat(port, *peers))
        case "gateway":
            _gateway(port, peers[0])
        case _:
            raise SystemExit(f"unknown role {role!r}; one of {ROLES}")


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "serve":
        raise SystemExit(__doc__)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    _serve(sys.argv[2], int(sys.argv[3]), [int(a) for a in sys.argv[4:]])
