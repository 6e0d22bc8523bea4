"""Replicas from DNS (discovery.py): a StatefulSet's pods by ordinal, joins at once, leaves after a grace."""

from __future__ import annotations

import asyncio

import pytest

from chatmesh.mesh.errors import InvalidArgument
from chatmesh.mesh.ids import ConversationId, ReplicaId
from chatmesh.router import discovery
from chatmesh.router.discovery import Pattern, Tracker
from chatmesh.router.membership import Membership
from chatmesh.router.ring import Replica, Ring

PATTERN = Pattern.parse("engine-{ordinal}.engine:50054")


def test_a_pods_name_gives_the_replica_id_and_address() -> None:
    assert PATTERN.replica(3) == Replica(ReplicaId("engine-3"), "engine-3.engine:50054")


@pytest.mark.parametrize("bad", ["engine-0.engine:50054", "engine-{ordinal}.engine", "engine-{ordinal}:port", ""])
def test_patterns_without_an_ordinal_or_port_are_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="CHATMESH_REPLICAS_DNS"):
        Pattern.parse(bad)


def resolver_of(names: set[str], asked: list[str]) -> discovery.Resolver:
    async def resolve(host: str, port: int) -> bool:
        asked.append(host)
        return host in names
    return resolve


async def test_lookup_bridges_a_gap_and_stops_after_a_run_of_misses() -> None:
    asked: list[str] = []
    found = await discovery.lookup(PATTERN, resolver_of({"engine-0.engine", "engine-1.engine", "engine-3.engine"},
                                                        asked))
    assert found == [0, 1, 3]  # engine-2 being replaced does not hide engine-3
    assert len(asked) == 4 + discovery.MISS_RUN  # 0..3, then 4..7 missing: bounded


def test_members_join_at_once_and_leave_only_after_missing_several_rounds() -> None:
    t = Tracker(PATTERN)
    joined, left = t.round([0, 1, 2])
    assert [r.id for r in joined] == ["engine-0", "engine-1", "engine-2"] and left == []
    for _ in range(discovery.REMOVE_AFTER - 1):  # engine-2 restarting: still a member
        assert t.round([0, 1]) == ([], [])
    assert t.round([0, 1, 2]) == ([], [])          # back in time: nothing changed, its count starts over
    for _ in range(discovery.REMOVE_AFTER - 1):
        assert t.round([0, 1]) == ([], [])
    joined, left = t.round([0, 1])                 # scaled down for good
    assert joined == [] and [r.id for r in left] == ["engine-2"]
    joined, left = t.round([0, 1, 2, 3])           # scaled up: both join at once
    assert [r.id for r in joined] == ["engine-2", "engine-3"] and left == []


async def test_the_ring_follows_the_lookups() -> None:
    names = {"engine-0.engine", "engine-1.engine"}
    membership = Membership(Ring(), (), watch=False)
    task = asyncio.create_task(discovery.watch(Tracker(PATTERN), 0.01, membership.add,
                                               lambda r: membership.remove(r.id), resolver_of(names, [])))
    try:
        async def replicas(want: set[str]) -> None:
            for _ in range(500):
                if {v.load.replica.id for v in membership.views()} == want:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"replicas {[v.load.replica.id for v in membership.views()]}, wanted {want}")

        await replicas({"engine-0", "engine-1"})
        names.add("engine-2.engine")
        await replicas({"engine-0", "engine-1", "engine-2"})
        picked = {membership.pick(ConversationId(f"c{i}"), frozenset())[0].replica.id for i in range(200)}
        assert picked == {"engine-0", "engine-1", "engine-2"}
        names.discard("engine-1.engine")
        await replicas({"engine-0", "engine-2"})
        assert all(membership.pick(ConversationId(f"c{i}"), frozenset())[0].replica.id != "engine-1"
                   for i in range(200))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
