"""CHATMESH_REPLICAS parsing and the health bookkeeping that feeds the ring."""

from __future__ import annotations

import pytest

from chatmesh.mesh.errors import InvalidArgument, Unavailable
from chatmesh.mesh.ids import ConversationId, ReplicaId
from chatmesh.router.membership import Membership, parse_replicas
from chatmesh.router.ring import Replica, Ring


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
