"""The fault-injection mesh: the real services as separate processes, a load of mobile-like clients, one fault at a
time, and the audit of what every client was acknowledged against what the store holds (issue 18).

`FaultMesh` starts three `sim` engines (engine, engine-1, engine-2), two chat processes (chat, chat-1) behind the
gateway's CHATMESH_CHAT_ADDRESSES, the store (embedded SQLite, or PostgreSQL at the URL given), router,
moderation and the gateway, with the per-user limits in a private Redis, each on a free loopback port, logs under
its folder (`chatmesh.mesh.up.Mesh` starts them). `kill(name, signal)` and `restart(name)` inject a fault into one
process and bring it back with the same settings; `Redis` is a private redis-server the run may stop and start;
`PrivatePostgres` a private cluster (pg_createcluster, on a free port) that a run may restart under load without
disturbing anyone else's database.

`Load` runs `conversations` clients through the gateway's SSE route. Each sends its conversation's turns one
after another, under a client-generated turn id, and retries the same turn id, as a mobile client does, on
anything but a final event (a broken stream, `turn.failed`, a 5xx or 429, a refused connection) with a short
backoff. A stream's final `turn.completed`, `turn.stopped` or `turn.blocked` acknowledges the turn with the text
that stream delivered. With `disconnect` set, the next streams are dropped by the client after their first delta
(the user went away; the retry then gets the stopped reply).

With `temperature` (and a seed per turn) the load samples, so a reply continued after a fault matches what
its client was shown only if the continuation draws what the first attempt drew (issue 33).

`audit` reads every conversation back (through the gateway) and counts what must be 0: acknowledged turns lost
(no stored reply), turn ids with two stored replies, acknowledged text that differs from the stored reply, turns
with an attempt whose text is not a prefix of the stored reply (spliced: a client was shown text the stored reply
contradicts, e.g. a takeover that regenerated instead of continuing), turns stored stopped that no client
stopped (cut by a fault, not by its user), turns stored as blocked (the load's text is benign, so a block can
only be an outage taken as a verdict), and traceback or unretrieved-exception lines in any service's log.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from chatmesh.mesh import settings
from chatmesh.mesh.up import Extra, Mesh, grpc_serving, http_answers, replicas_serving
from tests.conftest import free_port
from tests.e2e.conftest import mesh_env

SERVICES = ("engine", "chat", "store", "router", "moderation", "gateway")
LOG_PROBLEMS = ("Traceback", "Task exception was never retrieved", "Exception in callback", "exception was never")
FINALS = ("turn.completed", "turn.stopped", "turn.blocked")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


class Redis:
    """A private redis-server on a free port, no persistence: stop() and start() are the Redis fault."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.folder = folder
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        log = (self.folder / "redis.log").open("ab")
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.folder)],
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not port_open(self.port):
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


class PrivatePostgres:
    """A PostgreSQL cluster of this run's own (pg_createcluster, trust auth on loopback, database `test`), so a
    restart under load disturbs no one else's database. Needs the Debian postgresql-common tools and root."""

    def __init__(self, version: str = "15") -> None:
        self.version = version
        self.name = f"faults-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.port = free_port()

    @staticmethod
    def available() -> bool:
        return shutil.which("pg_createcluster") is not None and os.geteuid() == 0

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/test"

    def _ctl(self, *args: str) -> None:
        subprocess.run(["pg_ctlcluster", self.version, self.name, *args], check=True, capture_output=True)

    def create(self) -> None:
        subprocess.run(["pg_createcluster", self.version, self.name, "-p", str(self.port), "--start", "--",
                        "--auth-host=trust", "--auth-local=trust"], check=True, capture_output=True)
        subprocess.run(["runuser", "-u", "postgres", "--", "createdb", "-h", "127.0.0.1", "-p", str(self.port),
                        "test"], check=True, capture_output=True)

    def restart(self) -> None:
        self._ctl("restart", "-m", "fast")

    def drop(self) -> None:
        subprocess.run(["pg_dropcluster", self.version, self.name, "--stop"], capture_output=True)


@dataclass
class Proc:
    service: str
    env: Mapping[str, str] | None
    address: str  # "" for the gateway (HTTP)


class FaultMesh:
    def __init__(self, root: Path, database_url: str = "", schema: str = "", redis_url: str = "",
                 engines: int = 3, chats: int = 2, step_ms: int = 20, reply_tokens: int = 48,
                 env: Mapping[str, str] | None = None) -> None:
        self.root = root
        env = mesh_env(
            root / "data",
            CHATMESH_SIM_STEP_MS=str(step_ms),
            CHATMESH_MAX_REPLY_TOKENS=str(reply_tokens),
            CHATMESH_LIMIT_TURNS_PER_MINUTE="100000",
            CHATMESH_LIMIT_OPEN_STREAMS="1000",
            CHATMESH_LIMIT_PROMPT_TOKENS_PER_HOUR="1000000000",  # the load is one user's: no 429 in the figures
            CHATMESH_STORE_PURGE_INTERVAL_S="0",
            **(env or {}),  # a caller's own settings for every process (bench/rolling_restart.py)
        )
        if database_url:
            env["CHATMESH_DATABASE_URL"] = database_url
        if schema:
            env["CHATMESH_DATABASE_SCHEMA"] = schema
        if redis_url:
            env["CHATMESH_REDIS_URL"] = redis_url
        engine_addresses = [env["CHATMESH_ENGINE_ADDRESS"]] + [f"127.0.0.1:{free_port()}" for _ in range(engines - 1)]
        chat_addresses = [env["CHATMESH_CHAT_ADDRESS"]] + [f"127.0.0.1:{free_port()}" for _ in range(chats - 1)]
        env["CHATMESH_REPLICAS"] = ",".join(f"engine-{i}={a}" for i, a in enumerate(engine_addresses))
        env["CHATMESH_CHAT_ADDRESSES"] = ",".join(chat_addresses)
        self.extra = [Extra(f"engine-{i}", "engine", a, {"CHATMESH_REPLICA_ID": f"engine-{i}"})
                      for i, a in enumerate(engine_addresses) if i]
        self.extra += [Extra(f"chat-{i}", "chat", a, {"CHATMESH_CHAT_INSTANCE_ID": f"chat-{i}"})
                       for i, a in enumerate(chat_addresses) if i]
        self.mesh = Mesh(env=env, log_dir=root / "logs", start_timeout_s=180)
        cfg = self.mesh.cfg
        self.procs: dict[str, Proc] = {
            "store": Proc("store", None, cfg[settings.STORE_ADDRESS]),
            "moderation": Proc("moderation", None, cfg[settings.MODERATION_ADDRESS]),
            "engine": Proc("engine", None, cfg[settings.ENGINE_ADDRESS]),
            "router": Proc("router", None, cfg[settings.ROUTER_ADDRESS]),
            "chat": Proc("chat", None, cfg[settings.CHAT_ADDRESS]),
            "gateway": Proc("gateway", None, ""),
        }
        for x in self.extra:
            self.procs[x.name] = Proc(x.service, {settings.METRIC_PORTS[x.service].env: "0", **x.env,
                                                  "CHATMESH_LISTEN": x.address}, x.address)

    @property
    def url(self) -> str:
        return self.mesh.gateway_url

    def start(self) -> None:
        self.mesh.start(extra=self.extra)

    def stop(self) -> dict[str, int]:
        return self.mesh.stop()

    def names(self, service: str) -> list[str]:
        return [name for name, p in self.procs.items() if p.service == service]

    def pid(self, name: str) -> int:
        return self.mesh.procs[name].pid

    def chat_holding(self, holder: str) -> str:
        """The name of the chat process a turn record's lease holder (`name@address`) names."""
        address = holder.partition("@")[2]
        return next(name for name, p in self.procs.items() if p.service == "chat" and p.address == address)

    def kill(self, name: str, sig: signal.Signals, wait_s: float = 20.0) -> int:
        """Sends `sig` to one process and waits for it to exit; its exit code."""
        proc = self.mesh.procs[name]
        proc.send_signal(sig)
        return proc.wait(wait_s)

    def restart(self, name: str) -> None:
        """Starts `name` again with its settings (its log continues) and returns once it answers its health check."""
        p = self.procs[name]
        self.mesh._spawn(p.service, name, p.env)
        self.wait_healthy(name)

    def healthy(self, name: str) -> bool:
        p = self.procs[name]
        if p.service == "gateway":
            return http_answers(self.url + "/healthz", 0.5)
        return grpc_serving(self.mesh.trust(), p.address, p.service, 0.5)

    def wait_healthy(self, name: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy(name):
            if self.mesh.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited with {self.mesh.procs[name].returncode}; see its log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not become healthy in {timeout_s:.0f} s")
            time.sleep(0.05)

    def all_replicas_serving(self) -> bool:
        return replicas_serving(self.mesh.trust(), self.mesh.cfg[settings.ROUTER_ADDRESS])

    def log_lines(self, marker: str, prefix: str = "") -> int:
        """Lines holding `marker` in the logs of the processes whose name starts with `prefix`."""
        return sum(line.count(marker) for path in (self.root / "logs").glob(f"{prefix}*.log")
                   for line in path.read_text(errors="replace").splitlines())

    def log_problems(self) -> list[str]:
        """Traceback and unretrieved-exception lines in every service's log ('name: line')."""
        out: list[str] = []
        for path in sorted((self.root / "logs").glob("*.log")):
            for line in path.read_text(errors="replace").splitlines():
                if any(p in line for p in LOG_PROBLEMS):
                    out.append(f"{path.stem}: {line[:300]}")
        return out


# ---- the load ---------------------------------------------------------------------------------------------------


@dataclass
class Attempt:
    started: float
    ended: float
    outcome: str  # a final event name, or what went wrong: failed, broken, http_503, connect, disconnect...
    text: str
    detail: str = ""  # a turn.failed event's message (why the mesh failed the attempt)


@dataclass
class Turn:
    conversation: str
    turn_id: str
    content: str
    attempts: list[Attempt] = field(default_factory=list)
    acked: str = ""  # the final event that acknowledged it
    text: str = ""  # the text the acknowledging stream delivered
    seed: int = 0  # its sampling seed, when the load samples

    @property
    def acked_at(self) -> float | None:
        return self.attempts[-1].ended if self.acked else None


WORDS = ("river", "lantern", "orbit", "meadow", "cipher", "harbor", "quartz", "willow", "ember", "summit")


class Load:
    """Clients that each send their conversation's turns in order and retry a turn id until it is acknowledged."""

    def __init__(self, url: str, conversations: int, think_s: float = 0.05, attempt_timeout_s: float = 30.0,
                 turns_per_conversation: int = 4, temperature: float | None = None):
        self.url = url
        self.conversations = conversations
        self.turns_per_conversation = turns_per_conversation  # then the client starts a new conversation
        self.temperature = temperature  # None: the mesh's default (greedy); else sampled, with a seed per turn
        self.think_s = think_s
        self.timeout = httpx.Timeout(attempt_timeout_s, connect=2.0)
        self.turns: list[Turn] = []
        self.running = True
        self.disconnect = 0  # the next this-many streams are dropped by the client after their first delta
        self.tasks: list[asyncio.Task[None]] = []
        self.convs: list[str] = []

    async def start(self) -> None:
        self.tasks = [asyncio.create_task(self._client(i)) for i in range(self.conversations)]

    async def drain(self, timeout_s: float = 60.0) -> bool:
        """Stops new turns; waits for every client to finish the turn it is on. True when they all did."""
        self.running = False
        done, pending = await asyncio.wait(self.tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        return not pending

    async def _conversation(self, client: httpx.AsyncClient) -> str:
        """A new conversation, retried like a turn until the gateway answers."""
        backoff = 0.1
        while True:
            try:
                resp = await client.post("/v1/conversations", json={})
                if resp.status_code == 200 or resp.status_code == 201:
                    conv = str(resp.json()["id"])
                    self.convs.append(conv)
                    return conv
            except httpx.HTTPError:
                pass
            await asyncio.sleep(backoff)
            backoff = min(1.0, backoff * 2)

    async def _client(self, n: int) -> None:
        rng = random.Random(n)
        limits = httpx.Limits(max_connections=2, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout, limits=limits) as client:
            k = 0
            conv = ""
            while self.running:
                if k % self.turns_per_conversation == 0:
                    conv = await self._conversation(client)
                k += 1
                turn = Turn(conv, str(uuid.uuid4()),
                            f"Conversation {n} turn {k}: tell me about the {rng.choice(WORDS)} and the "
                            f"{rng.choice(WORDS)}.", seed=rng.randrange(2 ** 31))
                self.turns.append(turn)
                backoff = 0.1
                while True:
                    attempt = await self._attempt(client, turn)
                    turn.attempts.append(attempt)
                    if attempt.outcome in FINALS:
                        turn.acked, turn.text = attempt.outcome, attempt.text
                        break
                    await asyncio.sleep(backoff * (0.5 + rng.random()))
                    backoff = min(1.0, backoff * 2)
                await asyncio.sleep(self.think_s)

    async def _attempt(self, client: httpx.AsyncClient, turn: Turn) -> Attempt:
        started = time.monotonic()
        text: list[str] = []
        drop = False
        if self.disconnect > 0:
            self.disconnect -= 1
            drop = True
        outcome, detail = "broken", ""
        try:
            body: dict[str, Any] = {"turn_id": turn.turn_id, "content": turn.content}
            if self.temperature is not None:
                body["options"] = {"temperature": self.temperature, "seed": turn.seed}
            async with client.stream("POST", f"/v1/conversations/{turn.conversation}/turns", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    return Attempt(started, time.monotonic(), f"http_{resp.status_code}", "")
                event = ""
                async for line in resp.aiter_lines():
                    if line.startswith("event:"):
                        event = line.partition(":")[2].strip()
                    elif line.startswith("data:") and event:
                        data: dict[str, Any] = json.loads(line.partition(":")[2])
                        if event == "turn.delta":
                            text.append(str(data.get("text", "")))
                            if drop:
                                outcome = "disconnect"
                                break
                        elif event in FINALS or event == "turn.failed":
                            outcome = "failed" if event == "turn.failed" else event
                            detail = str(data.get("message", "")) if event == "turn.failed" else ""
                            break
        except httpx.ConnectError:
            outcome = "connect"
        except httpx.HTTPError as err:
            outcome = type(err).__name__
        return Attempt(started, time.monotonic(), outcome, "".join(text), detail[:160])


# ---- the audit --------------------------------------------------------------------------------------------------


@dataclass
class Audit:
    attempted: int = 0
    acknowledged: int = 0
    retried: int = 0  # turns that needed more than one attempt
    attempts: int = 0
    rate_limited: int = 0  # attempts refused 429 (a limit, not a fault: should stay 0 with the harness's limits)
    lost: int = 0  # acknowledged, but no reply stored
    two_replies: int = 0  # turn ids with more than one stored reply
    text_differs: int = 0  # acknowledged text != stored text
    spliced: int = 0  # an attempt was shown text that is not a prefix of the stored reply
    stopped_by_fault: int = 0  # stored stopped, yet no client of the turn stopped it or went away
    blocked: int = 0  # stored as blocked (the load is benign: an outage taken as a verdict)
    unacked_stored: int = 0  # never acknowledged (drained) but stored: fine, counted for the record
    stopped_ids: list[str] = field(default_factory=list)  # the turn ids stopped_by_fault counts
    log_problems: list[str] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.lost or self.two_replies or self.text_differs or self.spliced or self.stopped_by_fault
                    or self.blocked or self.log_problems)

    def row(self) -> dict[str, Any]:
        return {"attempted": self.attempted, "acknowledged": self.acknowledged, "retried": self.retried,
                "attempts": self.attempts, "rate_limited": self.rate_limited,
                "lost": self.lost, "two_replies": self.two_replies, "text_differs": self.text_differs,
                "spliced": self.spliced, "stopped_by_fault": self.stopped_by_fault,
                "blocked": self.blocked, "log_problems": len(self.log_problems)}


async def audit(url: str, turns: list[Turn], mesh: FaultMesh | None = None) -> Audit:
    out = Audit(attempted=len(turns), acknowledged=sum(1 for t in turns if t.acked),
                retried=sum(1 for t in turns if len(t.attempts) > 1), attempts=sum(len(t.attempts) for t in turns),
                rate_limited=sum(1 for t in turns for a in t.attempts if a.outcome == "http_429"))
    replies: dict[tuple[str, str], list[dict[str, Any]]] = {}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for conv in sorted({t.conversation for t in turns}):
            resp = await client.get(f"/v1/conversations/{conv}")
            resp.raise_for_status()
            for m in resp.json()["messages"]:
                if m["role"] == "assistant":
                    replies.setdefault((conv, m["turn_id"]), []).append(m)
                    if m["status"] == "blocked":
                        out.blocked += 1
    for t in turns:
        stored = replies.get((t.conversation, t.turn_id), [])
        if len(stored) > 1:
            out.two_replies += 1
        if stored:
            reply = stored[0]
            shown = next((a.text for a in t.attempts if not reply["content"].startswith(a.text)), None)
            if shown is not None:
                out.spliced += 1
                if len(out.examples) < 10:
                    out.examples.append(f"spliced {t.turn_id}: shown {shown!r} stored {reply['content']!r}")
            if reply["status"] == "stopped" and not any(a.outcome == "disconnect" for a in t.attempts):
                out.stopped_by_fault += 1
                out.stopped_ids.append(t.turn_id)
                if len(out.examples) < 10:
                    out.examples.append(f"stopped by a fault {t.turn_id}: {[a.outcome for a in t.attempts]}")
        if not t.acked:
            out.unacked_stored += bool(stored)
            continue
        if not stored:
            out.lost += 1
            out.examples.append(f"lost {t.turn_id}")
        elif stored[0]["content"] != t.text:
            out.text_differs += 1
            if len(out.examples) < 10:
                out.examples.append(f"differs {t.turn_id}: acked {t.text!r} stored {stored[0]['content']!r}")
    if mesh is not None:
        out.log_problems = mesh.log_problems()
    return out


def recovery(turns: list[Turn], fault_at: float, until: float, healthy_at: float | None = None) -> dict[str, Any]:
    """Per fault: turns affected (an attempt that did not succeed ended in [fault_at, until), the next fault's
    time), the time from the fault (or from the service healthy again) to the first acknowledged turn, and from
    the fault to the last affected turn's acknowledgement."""
    affected = [t for t in turns if any(fault_at <= a.ended < until and a.outcome not in FINALS
                                        for a in t.attempts)]
    unacked = sum(1 for t in affected if t.acked_at is None)
    acked = sorted(t.acked_at for t in affected if t.acked_at is not None)
    slowest = max(affected, key=lambda t: t.acked_at or float("inf"), default=None)

    def since(x: float | None, base: float | None) -> float | None:
        return round(x - base, 3) if x is not None and base is not None else None

    return {
        "affected": len(affected), "affected_unacked": unacked,
        "first_success_s": since(acked[0] if acked else None, fault_at),
        "last_affected_acked_s": since(acked[-1] if acked else None, fault_at),
        "healthy_s": since(healthy_at, fault_at),
        "first_success_after_healthy_s": since(acked[0] if acked else None, healthy_at),
        "last_affected_after_healthy_s": since(acked[-1] if acked else None, healthy_at),
        "slowest_attempts": [(round(a.started - fault_at, 2), round(a.ended - fault_at, 2), a.outcome, a.detail)
                             for a in slowest.attempts] if slowest is not None else [],
    }
