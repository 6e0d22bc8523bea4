"""RouteService settings: the replicas, the bounded-load parameters, leases and health (its metrics port is in chatmesh.mesh.settings)."""

from __future__ import annotations

from chatmesh.mesh.config import Setting, parse_bool
from chatmesh.router import ring

REPLICAS = Setting(
    "CHATMESH_REPLICAS", "",
    "engine replicas as id=host:port, comma-separated (empty: one replica engine-0 at CHATMESH_ENGINE_ADDRESS)",
    str)
REPLICAS_DNS = Setting(
    "CHATMESH_REPLICAS_DNS", "",
    "engine replicas from DNS, as a StatefulSet's pod name with {ordinal}, e.g. engine-{ordinal}.engine:50054: "
    "every ordinal whose name resolves is replica engine-<ordinal> (discovery.py; replaces CHATMESH_REPLICAS)", str)
REPLICAS_DNS_INTERVAL_S = Setting(
    "CHATMESH_REPLICAS_DNS_INTERVAL_S", 5.0, "seconds between lookups of CHATMESH_REPLICAS_DNS", float)
ROUTER_EPS = Setting(
    "CHATMESH_ROUTER_EPS", ring.DEFAULT_EPS,
    "bounded-load slack: a replica takes turns up to ceil((1+eps) x average load), then they spill", float)
ROUTER_MIN_SPILL_LOAD = Setting(
    "CHATMESH_ROUTER_MIN_SPILL_LOAD", 0,
    "floor under the load bound: a home with fewer in-flight turns never spills (0: the paper's rule)", int)
ROUTER_VNODES = Setting(
    "CHATMESH_ROUTER_VNODES", ring.DEFAULT_VNODES, "ring points per replica (consistent hashing)", int)
ROUTER_LEASE_TTL_S = Setting(
    "CHATMESH_ROUTER_LEASE_TTL_S", ring.DEFAULT_LEASE_TTL_S,
    "seconds an unreleased lease counts toward its replica's load", float)
ROUTER_HEALTH = Setting(
    "CHATMESH_ROUTER_HEALTH", True,
    "watch each engine's grpc.health.v1 status and stats (false: every configured replica is serving)", parse_bool)
ROUTER_STATS_INTERVAL_MS = Setting(
    "CHATMESH_ROUTER_STATS_INTERVAL_MS", 500, "how often engines report their load to the router", int)
