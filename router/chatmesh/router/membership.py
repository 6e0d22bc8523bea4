"""Membership: which replicas exist (configuration), which are serving (health) and how loaded (stats).

Replicas come from `CHATMESH_REPLICAS` ("engine-0=127.0.0.1:50054,engine-1=127.0.0.1:50064"); with none
configured, one replica `engine-0` at `CHATMESH_ENGINE_ADDRESS`. Every router process configured alike builds
the same ring, so all of them pick the same home for a conversation.

For each replica two watchers run on one channel:
- health: `grpc.health.v1.Health/Watch` for `chatmesh.v1.GenerateService`. SERVING puts the replica back in the
  walk; anything else, a broken stream or an unreachable engine takes it out (it keeps its ring points, so its
  conversations spill to the next replica and come back when it serves again). Until the first answer a replica
  is not serving ("connecting"): the router never sends a turn to an engine it has not heard from.
- load: `GenerateService/WatchStats`; running_sequences + queue_depth becomes the replica's engine load. With the
  follow policy the stream also asks for residency (include_residency): a full listing of the conversations the
  engine caches, then changes, fed to the policy's placement table (follow.py). A new stream starts with a
  full listing, which replaces what the last one said (the engine may have restarted empty). With pulls
  (follow.py), the stats also say whether the engine serves and receives prefix pulls and its KV layout
  (EngineStats.prefix_transfer): a replica is planned as a pull source only while its stats stream is open and
  it says it serves them, so a draining engine (SIGTERM: health NOT_SERVING, stats `draining`, pulls still
  answered through its grace period) stays a source while it takes no turns, and one that is gone is no source.
  Until its first report a replica neither serves nor receives pulls (an engine that never says so, never).
Both calls wait for the channel to connect (wait_for_ready) instead of failing while the engine is down, and the
channel retries its connection at most a second apart (`chatmesh.mesh.channels.RECONNECT`, on every channel
`open_channel` makes), so an engine that comes back is watched, and routed to, within about a second of
serving (gRPC's default backoff grows to ~10 s gaps after ten seconds down). A stream that ends or fails is
opened again after a capped exponential backoff.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chatmesh.mesh import logs
from chatmesh.mesh.channels import open_channel
from chatmesh.mesh.trust import Trust
from chatmesh.mesh.errors import InvalidArgument, Unavailable
from chatmesh.mesh.ids import ConversationId, LeaseId, ReplicaId
from chatmesh.router.follow import Follow
from chatmesh.router.ring import Lease, Pick, Replica, ReplicaLoad, Ring
from chatmesh.v1 import generate_pb2, generate_pb2_grpc

log = logs.get("chatmesh.router.membership")

GENERATE_SERVICE = "chatmesh.v1.GenerateService"
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.1, 2.0


def parse_replicas(text: str, default_address: str) -> tuple[Replica, ...]:
    """Parses "id=host:port,..." (empty: one replica engine-0 at `default_address`)."""
    if not text.strip():
        return (Replica(ReplicaId("engine-0"), default_address),)
    replicas: dict[ReplicaId, Replica] = {}
    for item in text.split(","):
        rid, sep, address = item.strip().partition("=")
        rid, address = rid.strip(), address.strip()
        if not sep or not rid or not address or ":" not in address:
            raise InvalidArgument(f"CHATMESH_REPLICAS: expected id=host:port, got {item.strip()!r}")
        if rid in replicas:
            raise InvalidArgument(f"CHATMESH_REPLICAS: replica {rid} is listed twice")
        replicas[ReplicaId(rid)] = Replica(ReplicaId(rid), address)
    return tuple(replicas.values())


@dataclass(frozen=True)
class ReplicaView:
    """A replica's load plus why it is not serving (empty when serving)."""

    load: ReplicaLoad
    reason: str
    cached_conversations: int = 0  # follow policy: conversations whose prefix the replica reports caching
    serves_pulls: bool = False     # follow with pulls: planned as a source (says it serves them, stream open)
    receives_pulls: bool = False   # follow with pulls: may be sent a turn that names a source
    draining: bool = False         # not serving turns, still serving pulls (SIGTERM, within its grace period)
    cached_tokens: int = 0         # follow policy: the tokens of those prefixes, as the table has them


class Membership:
    """The ring (a `Follow` ring when routing by residency) plus each replica's health reason; the watchers keep
    both current."""

    def __init__(self, ring: Ring, replicas: Sequence[Replica], watch: bool, trust: Trust = Trust.insecure()
                 ) -> None:
        self.ring = ring
        self.follow = ring if isinstance(ring, Follow) else None
        self.placement = ring.placement if isinstance(ring, Follow) else None
        self._watch = watch
        self._trust = trust  # the router's own: it calls the engines as spiffe://chatmesh/router
        self._reasons: dict[ReplicaId, str] = {}
        self.kv_usage: dict[ReplicaId, float] = {}  # device-tier KV occupancy each engine last reported, 0..1
        for r in replicas:
            self._add(r)
        self._stats_interval_ms: int | None = None  # set once the watchers run
        self._watching: dict[ReplicaId, tuple[grpc.aio.Channel, list[asyncio.Task[None]]]] = {}

    # ---- the core calls, with the clock and the reasons attached --------------------------------------

    def pick(self, conversation: ConversationId, exclude: frozenset[ReplicaId]) -> tuple[Pick, float]:
        """A pick and its lease expiry as Unix epoch seconds."""
        now = time.monotonic()
        try:
            pick = self.ring.pick(conversation, now, exclude)
        except Unavailable as err:
            down = [f"{rid}: {why}" for rid, why in sorted(self._reasons.items()) if why]
            raise Unavailable(f"{err}" + (f" ({'; '.join(down)})" if down else "")) from None
        return pick, time.time() + (pick.expires_at - now)

    def release(self, lease_id: LeaseId) -> Lease:
        self.ring.expire(time.monotonic())
        return self.ring.release(lease_id)

    def views(self) -> tuple[ReplicaView, ...]:
        self.ring.expire(time.monotonic())
        placement, follow = self.placement, self.follow
        views = []
        for load in self.ring.loads():
            rid = load.replica.id
            serves, receives = follow.pull_roles(rid) if follow is not None else (False, False)
            draining = follow is not None and follow.draining(rid)
            views.append(ReplicaView(load, self._reasons[rid], placement.conversations(rid) if placement else 0,
                                     serves, receives, draining, placement.tokens(rid) if placement else 0))
        return tuple(views)

    def mark(self, replica_id: ReplicaId, serving: bool, reason: str = "") -> None:
        was = self._reasons[replica_id]
        now_reason = "" if serving else (reason or "not serving")
        self._reasons[replica_id] = now_reason
        self.ring.set_serving(replica_id, serving)
        if was != now_reason:
            log.info("replica_state", replica_id=replica_id, serving=serving, reason=now_reason)

    # ---- watchers ------------------------------------------------------------------------------------

    def watchers(self, stats_interval_ms: int) -> list[asyncio.Task[None]]:
        """Starts the health and load watchers (none when watching is off)."""
        if not self._watch:
            return []
        self._stats_interval_ms = stats_interval_ms
        return [task for load in self.ring.loads() for task in self._start_watching(load.replica)]

    def _start_watching(self, replica: Replica) -> list[asyncio.Task[None]]:
        assert self._stats_interval_ms is not None
        channel = open_channel(self._trust, replica.address, "engine")
        tasks = [asyncio.create_task(self._watch_health(replica.id, channel)),
                 asyncio.create_task(self._watch_stats(replica.id, channel, self._stats_interval_ms))]
        self._watching[replica.id] = (channel, tasks)
        return tasks

    def add(self, replica: Replica) -> None:
        """A replica joins (discovery.py): on the ring, not serving until its health watch says so."""
        self._add(replica)
        if self._watch and self._stats_interval_ms is not None:
            self._start_watching(replica)

    def _add(self, replica: Replica) -> None:
        self.ring.add(replica, serving=not self._watch)
        self._reasons[replica.id] = "connecting" if self._watch else ""
        if self.follow is not None:
            self.follow.set_pulls(replica.id, False, False)  # until its stats say otherwise

    async def remove(self, replica_id: ReplicaId) -> None:
        """A replica leaves: its watchers stop, then it leaves the ring (its keys move to the next replicas)."""
        await self._stop_watching(replica_id)
        self.ring.remove(replica_id)
        self._reasons.pop(replica_id, None)
        self.kv_usage.pop(replica_id, None)

    async def _stop_watching(self, replica_id: ReplicaId) -> None:
        channel, tasks = self._watching.pop(replica_id) if replica_id in self._watching else (None, [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if channel is not None:
            await channel.close(None)

    async def close(self) -> None:
        for replica_id in list(self._watching):
            await self._stop_watching(replica_id)

    async def _watch_health(self, replica_id: ReplicaId, channel: grpc.aio.Channel) -> None:
        stub = health_pb2_grpc.HealthStub(channel)
        backoff = BACKOFF_MIN_S
        while True:
            try:
                async for resp in stub.Watch(health_pb2.HealthCheckRequest(service=GENERATE_SERVICE),
                                             wait_for_ready=True):
                    backoff = BACKOFF_MIN_S
                    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
                    self.mark(replica_id, resp.status == health_pb2.HealthCheckResponse.SERVING, f"health {status}")
                self.mark(replica_id, False, "health stream ended")
            except grpc.aio.AioRpcError as err:
                self.mark(replica_id, False, f"unreachable ({err.code().name})")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _watch_stats(self, replica_id: ReplicaId, channel: grpc.aio.Channel, interval_ms: int) -> None:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        placement, follow = self.placement, self.follow
        request = generate_pb2.WatchStatsRequest(interval_ms=interval_ms, include_residency=placement is not None)
        backoff = BACKOFF_MIN_S
        while True:
            delay = backoff
            try:
                async for resp in stub.WatchStats(request, wait_for_ready=True):
                    backoff = delay = BACKOFF_MIN_S
                    self.ring.set_engine_load(replica_id, resp.stats.running_sequences + resp.stats.queue_depth)
                    device = resp.stats.device
                    self.kv_usage[replica_id] = device.blocks_used / device.blocks_total if device.blocks_total else 0.0
                    if placement is not None and resp.HasField("residency"):
                        r = resp.residency
                        placement.report(replica_id, [(ConversationId(c.conversation_id), c.cached_tokens)
                                                      for c in r.conversations], full=r.full)
                    if follow is not None:
                        self._pull_roles(follow, replica_id, resp.stats)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    delay = 10.0  # an engine without stats: leases alone carry its load
            self.ring.set_engine_load(replica_id, 0)
            if follow is not None:
                follow.set_pulls(replica_id, False, False)  # no stream, no word that it still answers pulls
            await asyncio.sleep(delay)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _pull_roles(self, follow: Follow, replica_id: ReplicaId, stats: generate_pb2.EngineStats) -> None:
        """What the engine said of pulls: serves / receives, and its layout (only equal layouts exchange)."""
        pt = stats.prefix_transfer
        layout = pt.layout.SerializeToString(deterministic=True) if pt.HasField("layout") else None
        if follow.pull_roles(replica_id) != (pt.serves, pt.receives) or follow.layout(replica_id) != layout:
            follow.set_pulls(replica_id, pt.serves, pt.receives, layout)
            log.info("replica_pulls", replica_id=replica_id, serves=pt.serves, receives=pt.receives,
                     draining=stats.draining)
        if stats.draining and self._reasons.get(replica_id, "") and not self._reasons[replica_id].startswith("draining"):
            self._reasons[replica_id] = "draining (serving pulls until its grace period ends)"
