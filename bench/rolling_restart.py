"""A rolling restart of the engines under load, on the real mesh (issue 29, Deliver 7): each engine in turn gets
SIGTERM, drains (takes no new turns, keeps answering prefix pulls for CHATMESH_SHUTDOWN_GRACE_S), exits, is
started again and serves before the next one goes; meanwhile the router moves the draining engine's
conversations' next turns to the others naming it as their source, so they pull their history instead of
prefilling it.

The mesh is bench/fault_mesh.py's (three `sim` engines, chat, the store on SQLite, router, moderation, the
gateway, as separate processes) and so is the load: clients retrying each turn id through the gateway's SSE
route until acknowledged, then the audit (every acknowledged turn stored once, with the text its client got).

Where the prompt tokens came from is read from the engines themselves: every engine's GetStats (hit = its own
cache, pulled = prefix_transfer.pulled_tokens, miss = prefilled) polled through the run; an engine's counters
start again with its process, so the last figures each process reported (read once more just before its
SIGTERM; a draining engine admits nothing after it) are summed over the processes.
`cold` is what a restart that keeps nothing would have prefilled at least: every pulled token too. The same
figures over the drain windows alone (from each SIGTERM until that engine has exited: the turns its
conversations sent meanwhile, moved to the others) are where a restart's cost shows.

    flock /work/coord/heavy.lock .venv/bin/python -m bench.rolling_restart [--conversations 12] [--pulls on]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench.fault_mesh import Audit, FaultMesh, Load, audit
from chatmesh.mesh.channels import open_channel
from chatmesh.mesh.trust import Trust
from chatmesh.v1 import generate_pb2, generate_pb2_grpc, route_pb2, route_pb2_grpc

ENGINES = ("engine", "engine-1", "engine-2")  # process names; replica ids engine-0, engine-1, engine-2


def replica_of(name: str) -> str:
    return "engine-0" if name == "engine" else name


@dataclass
class Tokens:
    """Prompt tokens by where they came from, summed over engine processes."""

    cached: int = 0
    pulled: int = 0
    prefilled: int = 0

    @property
    def total(self) -> int:
        return self.cached + self.pulled + self.prefilled

    def share(self, part: int) -> float:
        return part / self.total if self.total else 0.0

    def __add__(self, other: Tokens) -> Tokens:
        return Tokens(self.cached + other.cached, self.pulled + other.pulled, self.prefilled + other.prefilled)

    def __sub__(self, other: Tokens) -> Tokens:
        return Tokens(self.cached - other.cached, self.pulled - other.pulled, self.prefilled - other.prefilled)


@dataclass
class Counters:
    """Each engine process's last reported (hit, pulled, miss); `banked` holds the processes that have exited."""

    last: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    banked: Tokens = field(default_factory=Tokens)

    def seen(self, name: str, hit: int, pulled: int, miss: int) -> None:
        old = self.last.get(name)
        if old is not None and (hit < old[0] or pulled < old[1] or miss < old[2]):  # a new process
            self.bank(name)
        self.last[name] = (hit, pulled, miss)

    def bank(self, name: str) -> None:
        hit, pulled, miss = self.last.pop(name, (0, 0, 0))
        self.banked = Tokens(self.banked.cached + hit, self.banked.pulled + pulled, self.banked.prefilled + miss)

    def tokens(self) -> Tokens:
        t = self.banked
        for hit, pulled, miss in self.last.values():
            t = Tokens(t.cached + hit, t.pulled + pulled, t.prefilled + miss)
        return t


async def read_stats(trust: Trust, mesh: FaultMesh, name: str, counters: Counters) -> bool:
    try:
        async with open_channel(trust, mesh.procs[name].address, "engine") as channel:
            s = (await generate_pb2_grpc.GenerateServiceStub(channel).GetStats(
                generate_pb2.GetStatsRequest(), timeout=1)).stats
    except grpc.aio.AioRpcError:
        return False
    counters.seen(name, s.hit_tokens, s.prefix_transfer.pulled_tokens, s.miss_tokens)
    return True


async def poll(trust: Trust, mesh: FaultMesh, counters: Counters, stop: asyncio.Event, every_s: float = 0.2) -> None:
    while not stop.is_set():
        for name in ENGINES:
            await read_stats(trust, mesh, name, counters)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def router_serves(trust: Trust, mesh: FaultMesh, replica: str, timeout_s: float = 30.0) -> float:
    """Seconds until the router lists `replica` serving again."""
    t0 = time.monotonic()
    async with open_channel(trust, mesh.procs["router"].address, "router") as channel:
        stub = route_pb2_grpc.RouteServiceStub(channel)
        while time.monotonic() - t0 < timeout_s:
            with contextlib.suppress(grpc.aio.AioRpcError):
                resp = await stub.ListReplicas(route_pb2.ListReplicasRequest(), timeout=1)
                if any(r.replica_id == replica and r.state == route_pb2.REPLICA_STATE_SERVING for r in resp.replicas):
                    return time.monotonic() - t0
            await asyncio.sleep(0.05)
    raise RuntimeError(f"the router did not serve {replica} again within {timeout_s:.0f} s")


@dataclass
class Result:
    audit: Audit
    tokens: Tokens
    before: Tokens  # what the engines had served when the first SIGTERM went out
    drains: Tokens  # what they served from each SIGTERM until that engine exited, summed
    restarts: list[dict[str, Any]]
    seconds: float

    @property
    def prefilled_share(self) -> float:
        return self.tokens.share(self.tokens.prefilled)

    @property
    def cold_share(self) -> float:
        """At least what a restart that kept nothing would have prefilled: the pulled tokens as well."""
        return self.tokens.share(self.tokens.prefilled + self.tokens.pulled)

    def row(self) -> dict[str, Any]:
        t = self.tokens
        return {"seconds": round(self.seconds, 1), **self.audit.row(), "prompt_tokens": t.total,
                "cached": round(t.share(t.cached), 4), "pulled": round(t.share(t.pulled), 4),
                "prefilled": round(self.prefilled_share, 4), "cold_at_least": round(self.cold_share, 4),
                "prefilled_before_restarts": round(self.before.share(self.before.prefilled), 4),
                "drains": {"prompt_tokens": self.drains.total, "cached": round(self.drains.share(self.drains.cached), 4),
                           "pulled": round(self.drains.share(self.drains.pulled), 4),
                           "prefilled": round(self.drains.share(self.drains.prefilled), 4)},
                "restarts": self.restarts}


async def run(root: Path, conversations: int = 12, turns_per_conversation: int = 6, warmup_s: float = 4.0,
              settle_s: float = 2.0, grace_s: float = 2.0, pulls: bool = True, chats: int = 1) -> Result:
    """One mesh, the load, every engine restarted in turn, the audit and the token figures."""
    env = {"CHATMESH_SHUTDOWN_GRACE_S": f"{grace_s:g}", "CHATMESH_ROUTER_PULLS": "true" if pulls else "false",
           "CHATMESH_SIM_REPLY_TOKENS": "0"}
    mesh = FaultMesh(root / "mesh", chats=chats, env=env)
    await asyncio.to_thread(mesh.start)
    trust = mesh.mesh.trust()
    counters = Counters()
    stop = asyncio.Event()
    restarts: list[dict[str, Any]] = []
    try:
        load = Load(mesh.url, conversations, turns_per_conversation=turns_per_conversation)
        await load.start()
        began = time.monotonic()
        poller = asyncio.create_task(poll(trust, mesh, counters, stop))
        await asyncio.sleep(warmup_s)
        before = counters.tokens()
        drains = Tokens()
        for name in ENGINES:
            at = time.monotonic()
            for other in ENGINES:  # its last figures (a draining engine admits nothing), and the others' now
                await read_stats(trust, mesh, other, counters)
            start = counters.tokens()
            exit_code = await asyncio.to_thread(mesh.kill, name, signal.SIGTERM, 60.0)
            counters.bank(name)
            for other in ENGINES:
                if other != name:
                    await read_stats(trust, mesh, other, counters)
            drains = drains + (counters.tokens() - start)
            gone = time.monotonic()
            await asyncio.to_thread(mesh.restart, name)
            serving = await router_serves(trust, mesh, replica_of(name))
            restarts.append({"engine": replica_of(name), "exit_code": exit_code, "drain_s": round(gone - at, 2),
                             "down_s": round(time.monotonic() - gone, 2), "router_serving_after_s": round(serving, 2)})
            await asyncio.sleep(settle_s)
        await load.drain()
        stop.set()
        await poller
        for name in ENGINES:
            await read_stats(trust, mesh, name, counters)
        seconds = time.monotonic() - began
        checked = await audit(mesh.url, load.turns, mesh)
        return Result(checked, counters.tokens(), before, drains, restarts, seconds)
    finally:
        stop.set()
        await asyncio.to_thread(mesh.stop)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=6, help="turns per conversation, then the client starts another")
    ap.add_argument("--warmup-s", type=float, default=6.0)
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--grace-s", type=float, default=2.0)
    ap.add_argument("--pulls", default="on,off", help="on, off, or both in one run (on,off)")
    args = ap.parse_args(argv)
    out = []
    with tempfile.TemporaryDirectory(prefix="rolling-") as tmp:
        for mode in args.pulls.split(","):
            r = asyncio.run(run(Path(tmp) / mode, args.conversations, args.turns, args.warmup_s, args.settle_s,
                                args.grace_s, pulls=mode == "on"))
            out.append({"pulls": mode, **r.row()})
            print(json.dumps(out[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
