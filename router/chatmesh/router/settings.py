"""RouteService settings: the replicas, the policy and its bound, leases and health (its metrics port is in
chatmesh.mesh.settings)."""

from __future__ import annotations

from chatmesh.mesh.config import Setting, parse_bool
from chatmesh.router import follow, link, ring

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
ROUTER_POLICY = Setting(
    "CHATMESH_ROUTER_POLICY", "follow",
    "follow: turns go where the engines report their conversation's prefix, first turns where load is lowest "
    "(follow.py); ring: consistent hashing with bounded loads (ring.py)", str, choices=("follow", "ring"))
ROUTER_EPS = Setting(
    "CHATMESH_ROUTER_EPS", follow.DEFAULT_EPS,
    "bounded-load slack: a replica takes turns up to ceil((1+eps) x average load), then they move (the ring "
    "policy was tuned at 0.5)", float)
ROUTER_MIN_SPILL_LOAD = Setting(
    "CHATMESH_ROUTER_MIN_SPILL_LOAD", follow.DEFAULT_FLOOR,
    "floor under the load bound: a replica with fewer in-flight turns never sends a turn away from its prefix "
    "(0: the paper's rule)", int)
ROUTER_HOLD_TOKENS = Setting(
    "CHATMESH_ROUTER_HOLD_TOKENS", follow.DEFAULT_HOLD_TOKENS,
    "follow: cached prefix tokens that let a turn stay home one sequence over the bound (0: never over)", int)
ROUTER_OVERSHOOT = Setting(
    "CHATMESH_ROUTER_OVERSHOOT", follow.DEFAULT_OVERSHOOT,
    "follow: no replica goes past ceil((1+eps+overshoot) x average load) while another has room", float)
ROUTER_PULLS = Setting(
    "CHATMESH_ROUTER_PULLS", True,
    "follow: a turn that moves off its prefix names the replica to pull it from, when the engines on both sides "
    "say they serve and receive pulls and pulling costs less than prefill (false: every move prefills)", parse_bool)
ROUTER_PULL_EPS = Setting(
    "CHATMESH_ROUTER_PULL_EPS", follow.DEFAULT_PULL_EPS,
    "follow with pulls: the bound's slack for a conversation whose prefix a move can pull (a move costs a pull, "
    "not a prefill, so the bound is tighter than CHATMESH_ROUTER_EPS)", float)
ROUTER_LINK_GBPS = Setting(
    "CHATMESH_ROUTER_LINK_GBPS", link.DEFAULT_NIC_GBPS,
    "follow with pulls: each NIC's bandwidth in Gb/s, for pricing a pull (the reference's node: 400 per GPU)", float)
ROUTER_LINK_NICS = Setting(
    "CHATMESH_ROUTER_LINK_NICS", link.DEFAULT_NICS,
    "follow with pulls: NICs a replica's GPUs move its KV over at once (TP 8: 8)", int)
ROUTER_LINK_LATENCY_MS = Setting(
    "CHATMESH_ROUTER_LINK_LATENCY_MS", link.DEFAULT_LATENCY_S * 1e3,
    "follow with pulls: fixed cost of one pull, ms (pulls smaller than it is worth in prefill are never planned)",
    float)
ROUTER_VNODES = Setting(
    "CHATMESH_ROUTER_VNODES", ring.DEFAULT_VNODES, "ring points per replica (consistent hashing)", int)
ROUTER_LEASE_TTL_S = Setting(
    "CHATMESH_ROUTER_LEASE_TTL_S", ring.DEFAULT_LEASE_TTL_S,
    "seconds an unreleased lease counts toward its replica's load", float)
ROUTER_HEALTH = Setting(
    "CHATMESH_ROUTER_HEALTH", True,
    "watch each engine's grpc.health.v1 status and stats (false: every configured replica is serving)", parse_bool)
ROUTER_STATS_INTERVAL_MS = Setting(
    "CHATMESH_ROUTER_STATS_INTERVAL_MS", 500,
    "how often engines report their load (and, for follow, the conversations they cache) to the router", int)
