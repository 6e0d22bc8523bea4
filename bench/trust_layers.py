"""What each layer of the mesh's trust costs one gRPC hop: plaintext vs TLS alone vs TLS + authorization vs all of it.

`bench.mesh_overhead --security` measures the whole (a turn through a plaintext mesh vs one with mutual TLS,
per-RPC authorization and owner tokens); this splits one hop into its layers. One server process per mode, all
up at once (each its own process, so none shares the measuring client's GIL), built from the bootstrap's own
pieces (`server.SERVER_OPTIONS`, `tls.server_credentials`, `authz.guarded`, `owner_guard.OwnerGuard`):

- `plain`: an insecure port, no interceptor (CHATMESH_MESH_PLAINTEXT);
- `tls`: mutual TLS (the dynamic, reloading server credentials; the client's `channels.open_channel`), no check;
- `authz`: `tls` plus the authorization check `server.start_server` installs (caller's identity, policy);
- `full`: `authz` plus an owner-token check in the handler (`OwnerGuard.owner`, a cached verification, with the
  presenter binding and retired-key check of issue 30; the streaming handler also asks `prompt_allowance`, as
  chat's SendTurn does) and the token in every call's metadata, as the store and engine take chat's calls (chat
  presenting the gateway's token);
- `client`: `full` as chat takes an internal client's calls (issue 30's grants): the client presents a token minted
  for itself, with scopes (checked against the RPC) and a per-turn budget;
- `base` (with `--base REV`): `full` served by REV's `chatmesh.mesh` (bench/trust_off's CHATMESH_BENCH_MESH_SRC),
  the owner check before a change, beside it in the same run.

Each round, in an order that changes every round, the client makes `--calls` sequential unary calls (a 100-byte
request and answer: the store's and router's shape) and `--streams` sequential server-streaming calls of
`--messages` 40-byte messages each (the engine's and chat's shape: one message per flushed chunk), timing each;
the servers' CPU is read from /proc. Reported per mode: unary round trip p50, a stream's time to its first message
p50, the time per streamed message after the first, and server CPU per unary call and per streamed message, each
with its difference from the layer below.

    .venv/bin/python -m bench.trust_layers --calls 2000 --streams 300 --messages 20 --rounds 5 [--base REV]

A turn makes `OWNER_CHECKS_PER_TURN` owner-checked calls (SendTurn at chat, BeginTurn and FinishTurn at the store,
Generate at the engine; longer turns add a store heartbeat each CHATMESH_CHAT_PROGRESS_INTERVAL_MS), so the
per-call CPU difference times that is what a change adds to a turn's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from chatmesh.mesh import authz, pki, server, tls, tokens
from chatmesh.mesh import identity as ident
from chatmesh.mesh.channels import open_channel
from chatmesh.mesh.ids import OwnerId
from chatmesh.mesh.owner_guard import OwnerGuard
from chatmesh.mesh.tls import TlsFiles
from chatmesh.mesh.trust import Trust

MODES = ("plain", "tls", "authz", "full", "client")
CLIENT = ident.client("bench")
OWNER_CHECKS_PER_TURN = 4
SERVICE = "bench.TrustLayers"
UNARY, STREAM = f"/{SERVICE}/Unary", f"/{SERVICE}/Stream"
OWNER = OwnerId("owner-bench")
CHUNK = b"x" * 40


def _policy() -> authz.Policy:
    return authz.Policy({UNARY: (ident.CHAT, CLIENT), STREAM: (ident.CHAT, CLIENT)})


def _serve(mode: str, folder: str) -> None:
    """A server process: prints its port, serves until stdin closes."""
    certs = Path(folder)

    async def run() -> None:
        guard = None
        if mode in ("full", "client", "base"):
            guard = OwnerGuard(tokens.Verifier(tokens.watch_keys(certs / pki.TOKEN_PUBLIC_KEYS_FILE)))
        allowance = getattr(guard, "prompt_allowance", None)  # none in a base before issue 30

        async def unary(request: bytes, context: Any) -> bytes:
            if guard is not None:
                guard.owner(context, OWNER)
            return request

        async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
            if guard is not None:
                guard.owner(context, OWNER)
                if allowance is not None:
                    allowance(context, 0)
            for _ in range(int(request)):
                yield CHUNK

        srv = grpc.aio.server(options=server.SERVER_OPTIONS)
        checked = authz.guarded(srv, authz.Guard(_policy())) if mode in ("authz", "full", "client", "base") else srv
        checked.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream)})])
        if mode == "plain":
            port = srv.add_insecure_port("127.0.0.1:0")
        else:
            watched = tls.watch(TlsFiles.in_folder(certs, ident.STORE), ident.STORE)
            port = srv.add_secure_port("127.0.0.1:0", tls.server_credentials(watched))
        await srv.start()
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await srv.stop(0)

    asyncio.run(run())


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    def __init__(self, mode: str, certs: Path, base_src: Path | None = None) -> None:
        self.mode = mode
        env = dict(os.environ)
        if base_src is not None:  # REV's chatmesh.mesh (bench/trust_off/sitecustomize.py)
            env["CHATMESH_BENCH_MESH_SRC"] = str(base_src)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent / "trust_off"),
                                                            env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from bench.trust_layers import _serve; _serve({mode!r}, {str(certs)!r})"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1], env=env)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


def _channel(mode: str, port: int, certs: Path) -> grpc.aio.Channel:
    address = f"127.0.0.1:{port}"
    if mode == "plain":
        return open_channel(Trust.insecure(), address, "store")
    who = CLIENT if mode == "client" else ident.CHAT
    return open_channel(Trust.from_files(TlsFiles.in_folder(certs, who), who, None), address, "store")


async def _measure(mode: str, port: int, certs: Path, calls: int, streams: int, messages: int,
                   minted: dict[str, str]) -> tuple[list[float], list[float], list[float]]:
    """Unary round trips; streams' first-message times; per-message times after the first (seconds)."""
    metadata = tokens.metadata_of(minted[mode]) if mode in minted else ()
    channel = _channel(mode, port, certs)
    try:
        unary = channel.unary_unary(UNARY, None, None)
        stream = channel.unary_stream(STREAM, None, None)
        request = b"r" * 100
        for _ in range(50):  # warm: connection, handshake, caches
            await unary(request, metadata=metadata)
        trips = []
        for _ in range(calls):
            start = time.perf_counter()
            await unary(request, metadata=metadata)
            trips.append(time.perf_counter() - start)
        firsts, per_message = [], []
        count = str(messages).encode()
        for _ in range(streams):
            start = time.perf_counter()
            first = 0.0
            n = 0
            async for _item in stream(count, metadata=metadata):
                n += 1
                if n == 1:
                    first = time.perf_counter()
            end = time.perf_counter()
            firsts.append(first - start)
            per_message.append((end - first) / max(1, n - 1))
        return trips, firsts, per_message
    finally:
        await channel.close(None)


def _base_mesh(rev: str, tmp: Path) -> Path:
    """`rev`'s chatmesh.mesh package, extracted under `tmp`."""
    root = Path(__file__).parents[1]
    archive = subprocess.run(["git", "-C", str(root), "archive", rev, "mesh/chatmesh/mesh"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    return tmp / "mesh" / "chatmesh" / "mesh"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--messages", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--append", help="append the results to this Markdown file")
    parser.add_argument("--base", default="", metavar="REV",
                        help="also a `base` mode: `full` with REV's chatmesh.mesh (the owner check before a change)")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    modes = (*MODES, "base") if args.base else MODES
    with tempfile.TemporaryDirectory() as tmp:
        certs = Path(tmp) / "certs"
        pki.ensure(certs, [ident.CHAT, ident.STORE, CLIENT])
        issuer = tokens.Issuer(tokens.watch_keys(pki.private_keys_file(certs)), 900)
        gateways = issuer.mint(OWNER, presenter=ident.GATEWAY).token  # chat forwards the gateway's
        minted = {"full": gateways, "base": gateways,
                  "client": issuer.mint(OWNER, presenter=CLIENT, scopes=("read", "turns", "Unary", "Stream"),
                                        prompt_allowance=4000).token}
        base_src = _base_mesh(args.base, Path(tmp)) if args.base else None
        servers = {m: Server(m, certs, base_src if m == "base" else None) for m in modes}
        results: dict[str, dict[str, list[float]]] = {
            m: {"trip": [], "first": [], "per_message": [], "cpu_unary": [], "cpu_message": []} for m in modes}
        try:
            for r in range(args.rounds):
                order = list(modes[r % len(modes):] + modes[:r % len(modes)])
                for mode in order if r % 2 == 0 else order[::-1]:
                    pid = servers[mode].proc.pid
                    before = cpu_seconds(pid)
                    trips, firsts, per = asyncio.run(_measure(mode, servers[mode].port, certs, args.calls, 0, 0,
                                                              minted))
                    mid = cpu_seconds(pid)
                    _, firsts, per = asyncio.run(_measure(mode, servers[mode].port, certs, 0, args.streams,
                                                          args.messages, minted))
                    after = cpu_seconds(pid)
                    res = results[mode]
                    res["trip"] += trips
                    res["first"] += firsts
                    res["per_message"] += per
                    res["cpu_unary"].append((mid - before) / (args.calls + 50))
                    res["cpu_message"].append((after - mid) / (args.streams * args.messages + 50))
        finally:
            for s in servers.values():
                s.stop()
    us = 1e6
    rows = []
    for mode in modes:
        res = results[mode]
        rows.append((mode, statistics.median(res["trip"]) * us, statistics.median(res["first"]) * us,
                     statistics.median(res["per_message"]) * us, statistics.mean(res["cpu_unary"]) * us,
                     statistics.mean(res["cpu_message"]) * us))
    names = {"plain": "plaintext", "tls": "mutual TLS, no checks", "authz": "mTLS + authorization",
             "full": "mTLS + authorization + owner token", "client": "full, as an internal client's (scopes, budget)",
             "base": f"full at {args.base} (--base)"}
    lines = [
        f"### One hop by trust layer ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{os.cpu_count()} cores, {platform.machine()}, {args.rounds} rounds, {args.calls} unary calls and "
        f"{args.streams} streams x {args.messages} messages per mode and round, load average {load_before:.1f} "
        f"before, {os.getloadavg()[0]:.1f} after)",
        "",
        "| layer | unary round trip p50 (us) | stream first message p50 (us) | per streamed message p50 (us) | "
        "server CPU per unary call (us) | server CPU per streamed message (us) |",
        "|---|---|---|---|---|---|",
    ]
    prev = None
    by_mode = {row[0]: row for row in rows}
    for row in rows:
        below = by_mode["full"] if row[0] in ("client", "base") else prev  # each beside the layer it adds to
        cells = [f"{v:.1f}" + (f" ({v - p:+.1f})" if below is not None else "")
                 for v, p in zip(row[1:], below[1:] if below is not None else row[1:])]
        lines.append(f"| {names[row[0]]} | " + " | ".join(cells) + " |")
        prev = row if row[0] in MODES[:4] else prev
    lines.append("")
    full = by_mode["full"]
    for other in ("base", "client"):
        if other in by_mode:
            per_call = full[4] - by_mode[other][4] if other == "base" else by_mode[other][4] - full[4]
            what = f"full vs {args.base}" if other == "base" else "an internal client's token vs the gateway's"
            lines.append(f"- {what}: {per_call:+.1f} us of server CPU per owner-checked call, "
                         f"{per_call * OWNER_CHECKS_PER_TURN:+.1f} us per turn ({OWNER_CHECKS_PER_TURN} such calls)")
    lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
