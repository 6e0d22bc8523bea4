"""CHATMESH_REPLICAS parsing, the health bookkeeping that feeds the ring, and the pull roles the stats set."""

from __future__ import annotations

import pytest

from chatmesh.mesh.errors import InvalidArgument, Unavailable
from chatmesh.mesh.ids import ConversationId, ReplicaId
from chatmesh.router.follow import Follow
from chatmesh.router.link import DEFAULT_COST
from chatmesh.router.membership import Membership, parse_replicas
from chatmesh.router.ring import Replica, Ring
from chatmesh.v1 import generate_pb2


def test_default_is_one_replica_at_the_engine_address() -> None:
    assert parse_replicas("", "127.0.0.1:50054") == (Replica(ReplicaId("engine-0"), "127.0.0.1:50054"),)


def test_parses_ids_and_addresses_in_order() -> None:
    got = parse_replicas(" engine-0=127.0.0.1:50054 , engine-1=10.0.0.2:50064", "unused")
    assert got == (Replica(ReplicaId("engine-0"), "127.0.0.1:50054"), Replica(ReplicaId("engine-1"), "10.0.0.2:50064"))


@pytest.mark.parametrize("bad", ["engine-0", "=127.0.0.1:1", "engine-0=", "engine-0=localhost",
                                 "a=h:1,a=h:2", "a=h:1,"])
def test_bad_replica_lists_are_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="CHATMESH_REPLICAS"):
        parse_replicas(bad, "unused")


def test_watched_replicas_start_not_serving_and_follow_marks() -> None:
    m = Membership(Ring(), parse_replicas("a=h:1,b=h:2", "unused"), watch=True)
    assert {v.load.replica.id: (v.load.serving, v.reason) for v in m.views()} == {
        "a": (False, "connecting"), "b": (False, "connecting")}
    with pytest.raises(Unavailable, match=r"none of 2 replicas is serving \(a: connecting; b: connecting\)"):
        m.pick(ConversationId("c"), frozenset())
    m.mark(ReplicaId("b"), True)
    pick, expires_at_s = m.pick(ConversationId("c"), frozenset())
    assert pick.replica.id == "b" and expires_at_s > 0
    m.mark(ReplicaId("b"), False, "health NOT_SERVING")
    assert [v.reason for v in m.views()] == ["connecting", "health NOT_SERVING"]


def test_pull_roles_come_from_the_engines_stats_and_only_equal_layouts_exchange() -> None:
    """A replica is planned as a source or target only as its stats say (a triton engine says neither), and a pull
    is planned only between replicas whose KV layouts are equal."""
    policy = Follow(min_spill_load=0, pulls=DEFAULT_COST)
    m = Membership(policy, parse_replicas("a=h:1,b=h:2,c=h:3", "unused"), watch=False)
    a, b, c = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
    assert [policy.pull_roles(r) for r in (a, b, c)] == [(False, False)] * 3  # nothing said yet: no pulls

    def stats(serves: bool, receives: bool, backend: str) -> generate_pb2.EngineStats:
        layout = generate_pb2.KvLayout(backend=backend, block_size=16, dtype="none", block_bytes=0)
        return generate_pb2.EngineStats(prefix_transfer=generate_pb2.PrefixTransferStats(
            serves=serves, receives=receives, layout=layout if serves or receives else None))

    m._pull_roles(policy, a, stats(True, True, "sim"))
    m._pull_roles(policy, b, stats(True, True, "sim"))
    m._pull_roles(policy, c, stats(False, False, "triton"))
    assert [policy.pull_roles(r) for r in (a, b, c)] == [(True, True), (True, True), (False, False)]
    key = ConversationId("conv")
    policy.placement.report(a, [(key, 3000)])
    assert policy.source_for(key, b) == (a, 3000)
    assert policy.source_for(key, c) == (None, 0)  # c cannot receive
    m._pull_roles(policy, b, stats(True, True, "local"))  # another layout: blocks would not fit
    assert policy.source_for(key, b) == (None, 0)
    assert [v.serves_pulls for v in m.views()] == [True, True, False]
