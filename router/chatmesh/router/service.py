"""RouteService: the thin gRPC layer over the routing policy (`follow.py` by default, or the ring's bounded-load
walk, `ring.py`: CHATMESH_ROUTER_POLICY) and the membership (`membership.py`).

PickReplica validates the conversation id (1-128 bytes), picks a replica and returns it, its address, the lease,
home, spill or placed, and the home. ReleaseLease closes a lease (NOT_FOUND when
unknown or expired). ListReplicas shows every configured replica with its state and load. Core errors become
gRPC codes in `chatmesh.mesh.server`. Metrics (served by the bootstrap on CHATMESH_ROUTER_METRICS_PORT): picks by
outcome (home or spill reason) and replica, spills by reason, per-replica load, leases and serving state. The
router sees conversation ids only, never prompt text.
"""

from __future__ import annotations

import asyncio
import collections
import typing
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from chatmesh.mesh import identity
from chatmesh.mesh.trust import Trust
from chatmesh.mesh import logs, metrics
from chatmesh.mesh import settings as mesh_settings
from chatmesh.mesh.config import Config
from chatmesh.mesh.errors import NotFound
from chatmesh.mesh.ids import ReplicaId, parse_lease_id
from chatmesh.mesh.server import Service, unary_errors
from chatmesh.router import capacity, discovery, settings
from chatmesh.router.link import Link, PrefixCost
from chatmesh.router.follow import Follow
from chatmesh.router.membership import Membership, parse_replicas
from chatmesh.router.ring import PickOutcome, Ring, parse_conversation_key
from chatmesh.v1 import route_pb2, route_pb2_grpc

log = logs.get("chatmesh.router.service")

Context = grpc.aio.ServicerContext[Any, Any]
_NO_EXCLUSIONS: frozenset[ReplicaId] = frozenset()


def outcome_pb(outcome: PickOutcome) -> route_pb2.PickOutcome:
    match outcome:
        case PickOutcome.HOME:
            return route_pb2.PICK_OUTCOME_HOME
        case (PickOutcome.SPILL_OVER_BOUND | PickOutcome.SPILL_HOME_DOWN | PickOutcome.SPILL_EXCLUDED
              | PickOutcome.SPILL_HOME_DRAINING):
            return route_pb2.PICK_OUTCOME_SPILL
        case PickOutcome.PLACED:
            return route_pb2.PICK_OUTCOME_PLACED
        case _:
            typing.assert_never(outcome)


class _Collector(Collector):
    """Everything the router exports, read at scrape time: the pick and release counts (plain ints the hot
    path bumps, no lock or label lookup per call) and the per-replica load from the ring."""

    def __init__(self, membership: Membership, metrics: Metrics) -> None:
        self._membership = membership
        self._metrics = metrics

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        picks = CounterMetricFamily("chatmesh_router_picks",
                                    "picks by outcome (home or spill reason) and the replica picked",
                                    labels=["outcome", "replica"])
        spills = CounterMetricFamily("chatmesh_router_spills", "turns sent away from their home replica",
                                     labels=["reason"])
        by_outcome = dict.fromkeys(PickOutcome, 0)
        for (outcome, replica), count in self._metrics.picks.items():
            picks.add_metric([outcome.value, replica], count)
            by_outcome[outcome] += count
        for outcome, count in by_outcome.items():
            if outcome.spilled:
                spills.add_metric([outcome.value.removeprefix("spill_")], count)
        releases = CounterMetricFamily("chatmesh_router_releases", "leases released by outcome",
                                       labels=["outcome"])
        for name, count in self._metrics.releases.items():
            releases.add_metric([name], count)
        pulls = CounterMetricFamily("chatmesh_router_pull_picks",
                                    "picks that named a source replica to pull the prefix from", labels=["source"])
        pull_tokens = CounterMetricFamily("chatmesh_router_pull_planned_tokens",
                                          "prefix tokens the router believed those sources held", labels=["source"])
        for source, (count, tokens) in self._metrics.pulls.items():
            pulls.add_metric([source], count)
            pull_tokens.add_metric([source], tokens)
        yield from (picks, spills, releases, pulls, pull_tokens)
        load = GaugeMetricFamily("chatmesh_router_replica_load",
                                 "in-flight sequences the engine reported plus open leases", labels=["replica"])
        leases = GaugeMetricFamily("chatmesh_router_open_leases", "leases handed out and not yet released",
                                   labels=["replica"])
        serving = GaugeMetricFamily("chatmesh_router_replica_serving", "1 when the replica is in the walk",
                                    labels=["replica"])
        kv = GaugeMetricFamily("chatmesh_router_replica_kv_usage_ratio",
                               "device-tier KV blocks in use as the replica last reported, 0..1", labels=["replica"])
        for view in self._membership.views():
            rid = view.load.replica.id
            load.add_metric([rid], view.load.load)
            leases.add_metric([rid], view.load.open_leases)
            serving.add_metric([rid], 1.0 if view.load.serving else 0.0)
            if rid in self._membership.kv_usage:
                kv.add_metric([rid], self._membership.kv_usage[rid])
        yield from (load, leases, serving, kv)


class Metrics:
    """Counts kept as plain ints (one event loop owns them) and exported by `_Collector` at scrape time into the
    service's registry; spills by reason are the spilled outcomes' pick counts."""

    def __init__(self, membership: Membership, registry: metrics.Registry | None = None) -> None:
        self.picks: collections.Counter[tuple[PickOutcome, ReplicaId]] = collections.Counter()
        self.releases: dict[str, int] = {"released": 0, "unknown": 0}
        self.pulls: dict[ReplicaId, tuple[int, int]] = {}  # source -> (picks naming it, tokens planned)
        self.registry = registry or metrics.Registry(process=False)
        self.registry.collector(_Collector(membership, self))


class RouteServicer(route_pb2_grpc.RouteServiceServicer):
    def __init__(self, membership: Membership, metrics: Metrics) -> None:
        self._membership = membership
        self._metrics = metrics

    @unary_errors
    async def PickReplica(self, request: route_pb2.PickReplicaRequest,
                          context: Context) -> route_pb2.PickReplicaResponse:
        conversation = parse_conversation_key(request.conversation_id)
        excluded = request.exclude_replica_ids
        exclude = frozenset(ReplicaId(r) for r in excluded) if excluded else _NO_EXCLUSIONS
        pick, expires_at_s = self._membership.pick(conversation, exclude)
        self._metrics.picks[pick.outcome, pick.replica.id] += 1
        source = pick.source
        if source is not None:
            count, tokens = self._metrics.pulls.get(source.id, (0, 0))
            self._metrics.pulls[source.id] = (count + 1, tokens + pick.source_tokens)
        return route_pb2.PickReplicaResponse(
            replica_id=pick.replica.id, address=pick.replica.address, lease_id=pick.lease_id,
            outcome=outcome_pb(pick.outcome), home_replica_id=pick.home,
            lease_expires_at_ms=int(expires_at_s * 1000),
            source_replica_id=source.id if source is not None else "",
            source_address=source.address if source is not None else "", source_cached_tokens=pick.source_tokens)

    @unary_errors
    async def ReleaseLease(self, request: route_pb2.ReleaseLeaseRequest,
                           context: Context) -> route_pb2.ReleaseLeaseResponse:
        lease_id = parse_lease_id(request.lease_id)
        try:
            lease = self._membership.release(lease_id)
        except NotFound:
            self._metrics.releases["unknown"] += 1
            raise
        self._metrics.releases["released"] += 1
        return route_pb2.ReleaseLeaseResponse(replica_id=lease.replica)

    @unary_errors
    async def ListReplicas(self, request: route_pb2.ListReplicasRequest,
                           context: Context) -> route_pb2.ListReplicasResponse:
        return route_pb2.ListReplicasResponse(replicas=[
            route_pb2.ReplicaStatus(
                replica_id=v.load.replica.id, address=v.load.replica.address,
                state=route_pb2.REPLICA_STATE_SERVING if v.load.serving else (
                    route_pb2.REPLICA_STATE_DRAINING if v.draining else route_pb2.REPLICA_STATE_NOT_SERVING),
                engine_load=v.load.engine_load, open_leases=v.load.open_leases, load=v.load.load,
                reason=v.reason, cached_conversations=v.cached_conversations, serves_pulls=v.serves_pulls,
                receives_pulls=v.receives_pulls, cached_tokens=v.cached_tokens)
            for v in self._membership.views()
        ])


# Who may call what (authz.py): chat routes turns; the operator (and `chatmesh up`) may list replicas.
AUTHZ = {"chatmesh.v1.RouteService": {"PickReplica": [identity.CHAT], "ReleaseLease": [identity.CHAT],
                                      "ListReplicas": [identity.CHAT, identity.OPERATOR]}}


def build(cfg: Config, trust: Trust | None = None) -> Service:
    """The router; `trust` is the process's (default: what the settings say, as spiffe://chatmesh/router)."""
    trust = trust or Trust.from_config(cfg, identity.ROUTER)
    dns = discovery.Pattern.parse(cfg[settings.REPLICAS_DNS]) if cfg[settings.REPLICAS_DNS] else None
    replicas = () if dns else parse_replicas(cfg[settings.REPLICAS], cfg[mesh_settings.ENGINE_ADDRESS])
    vnodes, eps, ttl = cfg[settings.ROUTER_VNODES], cfg[settings.ROUTER_EPS], cfg[settings.ROUTER_LEASE_TTL_S]
    floor = cfg[settings.ROUTER_MIN_SPILL_LOAD]
    pulls = PrefixCost.from_plan(capacity.plan(), Link.from_gbps(
        cfg[settings.ROUTER_LINK_GBPS], cfg[settings.ROUTER_LINK_NICS], cfg[settings.ROUTER_LINK_LATENCY_MS] / 1e3)
    ) if cfg[settings.ROUTER_PULLS] else None
    ring = Follow(vnodes=vnodes, eps=eps, lease_ttl_s=ttl, min_spill_load=floor,
                  hold_tokens=cfg[settings.ROUTER_HOLD_TOKENS], overshoot=cfg[settings.ROUTER_OVERSHOOT],
                  pulls=pulls, pull_eps=cfg[settings.ROUTER_PULL_EPS]) \
        if cfg[settings.ROUTER_POLICY] == "follow" else Ring(vnodes=vnodes, eps=eps, lease_ttl_s=ttl,
                                                            min_spill_load=floor)
    membership = Membership(ring, replicas, watch=cfg[settings.ROUTER_HEALTH], trust=trust)
    registry = metrics.Registry()
    servicer = RouteServicer(membership, Metrics(membership, registry))
    service = Service(name="router", register=lambda server: _register(server, servicer),
                      close=membership.close, metrics=registry, authz=AUTHZ)

    async def start() -> None:
        service.background.extend(membership.watchers(cfg[settings.ROUTER_STATS_INTERVAL_MS]))
        if dns is not None:  # membership follows the StatefulSet (discovery.py), first round before serving
            tracker = discovery.Tracker(dns)
            for replica in tracker.round(await discovery.lookup(dns))[0]:
                membership.add(replica)
            service.background.append(asyncio.create_task(discovery.watch(
                tracker, cfg[settings.REPLICAS_DNS_INTERVAL_S], membership.add, lambda r: membership.remove(r.id))))
        log.info("router_ready", replicas=len(ring.loads()), policy=cfg[settings.ROUTER_POLICY], eps=ring.eps,
                 vnodes=ring.vnodes, min_spill_load=ring.min_spill_load)

    service.start = start
    return service


def _register(server: grpc.aio.Server, servicer: RouteServicer) -> Sequence[str]:
    route_pb2_grpc.add_RouteServiceServicer_to_server(servicer, server)
    return [route_pb2.DESCRIPTOR.services_by_name["RouteService"].full_name]
