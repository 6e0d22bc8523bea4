"""The ring's invariants: bounded loads, home affinity, minimal movement, leases, health, determinism."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatmesh.mesh.errors import InvalidArgument, NotFound, Unavailable
from chatmesh.mesh.ids import ConversationId, LeaseId, ReplicaId
from chatmesh.router.ring import (
    Pick,
    PickOutcome,
    Replica,
    Ring,
    load_bound,
    parse_conversation_key,
)


def replicas(n: int, first: int = 0) -> list[Replica]:
    return [Replica(ReplicaId(f"engine-{i}"), f"127.0.0.1:{50000 + i}") for i in range(first, first + n)]


def conv(i: int) -> ConversationId:
    return ConversationId(f"conversation-{i}")


# An op: ("pick", conversation, excluded replica index or -1) | ("release", nth open lease) |
# ("engine", replica index, reported in-flight) | ("health", replica index, serving)
ops = st.lists(st.one_of(
    st.tuples(st.just("pick"), st.integers(0, 200), st.integers(-1, 7)),
    st.tuples(st.just("release"), st.integers(0, 1000)),
    st.tuples(st.just("engine"), st.integers(0, 7), st.integers(0, 12)),
    st.tuples(st.just("health"), st.integers(0, 7), st.booleans()),
), max_size=300)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 8), eps=st.sampled_from([0.0, 0.1, 0.25, 1.0]), vnodes=st.sampled_from([1, 8, 40]),
       floor=st.sampled_from([0, 0, 3]), script=ops)
def test_bounded_load_and_home_affinity(n: int, eps: float, vnodes: int, floor: int,
                                        script: list[tuple[str, int] | tuple[str, int, int] | tuple[str, int, bool]]
                                        ) -> None:
    ring = Ring(replicas(n), vnodes=vnodes, eps=eps, min_spill_load=floor)
    ids = [r.id for r in replicas(n)]
    open_leases: list[LeaseId] = []
    for op in script:
        match op:
            case ("pick", c, x):
                exclude = frozenset([ids[x]]) if 0 <= x < n else frozenset()
                serving = [r for r in ids if ring.loads()[ids.index(r)].serving]
                if not serving or set(serving) <= exclude:
                    with pytest.raises(Unavailable, match="^no healthy replica: "):
                        ring.pick(conv(c), 0.0, exclude)
                    continue
                before = {r: ring.load(r) for r in ids}
                bound = load_bound(sum(before[r] for r in serving) + 1, len(serving), eps, floor)
                assert bound == ring.bound()
                walk = ring.walk(conv(c))
                home = walk[0]
                pick = ring.pick(conv(c), 0.0, exclude)
                open_leases.append(pick.lease_id)
                chosen = pick.replica.id
                assert pick.home == home and chosen in serving and chosen not in exclude
                room = [r for r in serving if r not in exclude and before[r] < bound]
                if room:
                    # Never over the bound while some replica has room ...
                    assert ring.load(chosen) <= bound
                    # ... and the first replica with room clockwise from the conversation's point.
                    assert chosen == next(r for r in walk if r in room)
                if home in serving and home not in exclude and before[home] < bound:
                    assert chosen == home  # a conversation under the bound always lands home
                # The outcome tells the truth: home when it landed home (even over the bound, when every
                # replica it may use is over it), a spill otherwise.
                if chosen == home:
                    assert pick.outcome is PickOutcome.HOME
                else:
                    assert pick.outcome.spilled
                if not exclude:
                    assert room  # the least-loaded serving replica is always under the bound
            case ("release", k):
                if open_leases:
                    lease = ring.release(open_leases.pop(k % len(open_leases)))
                    assert lease.replica in ids
            case ("engine", r, load) if r < n:
                ring.set_engine_load(ids[r], load)
            case ("health", r, up) if r < n:
                ring.set_serving(ids[r], bool(up))
            case _:
                pass
    assert ring.open_leases == len(open_leases)
    assert sum(x.open_leases for x in ring.loads()) == len(open_leases)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 12))
def test_adding_a_replica_moves_about_one_in_n_plus_one_all_to_it(n: int) -> None:
    keys = [conv(i) for i in range(3000)]
    ring = Ring(replicas(n))
    before = {k: ring.home(k) for k in keys}
    newcomer = replicas(1, first=n)[0]
    ring.add(newcomer)
    moved = [k for k in keys if ring.home(k) != before[k]]
    assert all(ring.home(k) == newcomer.id for k in moved)
    share = len(moved) / len(keys)
    assert 0.6 / (n + 1) <= share <= 1.45 / (n + 1)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 12), gone=st.integers(0, 11))
def test_removing_a_replica_moves_only_its_own(n: int, gone: int) -> None:
    keys = [conv(i) for i in range(2000)]
    ring = Ring(replicas(n))
    before = {k: ring.home(k) for k in keys}
    victim = ReplicaId(f"engine-{gone % n}")
    ring.remove(victim)
    for k in keys:
        assert (ring.home(k) == before[k]) == (before[k] != victim)


def test_same_membership_same_homes_in_any_order_and_process() -> None:
    a, b = Ring(replicas(5)), Ring(list(reversed(replicas(5))))
    homes = [a.home(conv(i)) for i in range(200)]
    assert homes == [b.home(conv(i)) for i in range(200)]
    code = ("from chatmesh.router.ring import Ring, Replica; from chatmesh.mesh.ids import ReplicaId; "
            "r = Ring([Replica(ReplicaId(f'engine-{i}'), 'x') for i in range(5)]); "
            "print(','.join(r.home(f'conversation-{i}') for i in range(200)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert out.split(",") == homes


def test_unhealthy_home_spills_and_returns() -> None:
    ring = Ring(replicas(3))
    keys = [conv(i) for i in range(300)]
    homes = {k: ring.home(k) for k in keys}
    down = ReplicaId("engine-1")
    ring.set_serving(down, False)


    def pick_and_release(k: ConversationId) -> Pick:
        p = ring.pick(k, 0.0)
        ring.release(p.lease_id)
        return p

    for k in keys:
        p = pick_and_release(k)
        assert p.replica.id != down
        assert (p.outcome is PickOutcome.SPILL_HOME_DOWN) == (homes[k] == down)
    ring.set_serving(down, True)
    assert all(pick_and_release(k).replica.id == homes[k] for k in keys)


def test_lease_expires_after_ttl_so_a_crashed_caller_cannot_pin_load() -> None:
    ring = Ring(replicas(2), lease_ttl_s=10.0)
    pick = ring.pick(conv(1), now=100.0)
    assert pick.expires_at == 110.0 and ring.load(pick.replica.id) == 1
    assert ring.expire(109.9) == 0
    other = ring.pick(conv(2), now=110.0)  # the next pick expires the stale lease on its way
    assert ring.load(pick.replica.id) == (1 if other.replica.id == pick.replica.id else 0)
    with pytest.raises(NotFound):
        ring.release(pick.lease_id)
    assert ring.release(other.lease_id).replica == other.replica.id
    with pytest.raises(NotFound):
        ring.release(other.lease_id)


def test_expiry_after_out_of_order_releases() -> None:
    ring = Ring(replicas(3), lease_ttl_s=10.0)
    first, second, third = (ring.pick(conv(i), now=t) for i, t in ((1, 0.0), (2, 5.0), (3, 6.0)))
    ring.release(first.lease_id)  # the oldest goes first: the next expiry is now the second's
    assert ring.expire(9.0) == 0 and ring.open_leases == 2
    assert ring.expire(15.0) == 1 and ring.lease(second.lease_id) is None
    assert ring.lease(third.lease_id) == (third.lease_id, third.replica.id, 16.0)
    ring.release(third.lease_id)
    assert ring.expire(100.0) == 0 and ring.open_leases == 0
    assert sum(ring.load(r.id) for r in replicas(3)) == 0


def test_lease_counter_wraps_and_ids_stay_uuids() -> None:
    import uuid

    from chatmesh.router import ring as ring_module

    ring = Ring(replicas(2))
    ring._lease_seq = ring_module._SEQ_END - 2  # two before the wrap
    ids = [ring.pick(conv(i), 0.0).lease_id for i in range(3)]
    assert [i[-8:] for i in ids] == ["ffffffff", "00000000", "00000001"]
    assert all(str(uuid.UUID(i)) == i for i in ids) and len({i[:-8] for i in ids}) == 1


def test_over_bound_home_spills_to_next_on_ring() -> None:
    ring = Ring(replicas(4), eps=0.0)
    key = conv(7)
    walk = ring.walk(key)
    ring.set_engine_load(walk[0], 5)  # total 6 with the incoming turn: bound ceil(6/4) = 2
    pick = ring.pick(key, 0.0)
    assert pick.outcome is PickOutcome.SPILL_OVER_BOUND and pick.replica.id == walk[1] and pick.home == walk[0]


def test_lease_ids_are_uuids_and_unique() -> None:
    import uuid

    ring = Ring(replicas(2))
    ids = {ring.pick(conv(i), 0.0).lease_id for i in range(1000)}
    assert len(ids) == 1000
    assert all(str(uuid.UUID(i)) == i for i in ids)


def test_conversation_key_limits() -> None:
    assert parse_conversation_key("c" * 128) == "c" * 128
    for bad in ["", "é" * 65]:
        with pytest.raises(InvalidArgument):
            parse_conversation_key(bad)


def test_no_replicas_is_unavailable() -> None:
    with pytest.raises(Unavailable, match="no replica is configured"):
        Ring().pick(conv(1), 0.0)


def test_spill_floor_keeps_low_load_turns_home() -> None:
    paper, floored = Ring(replicas(2), eps=0.5), Ring(replicas(2), eps=0.5, min_spill_load=8)
    key = conv(3)
    home = paper.home(key)
    for ring in (paper, floored):
        ring.set_engine_load(home, 3)  # 4 in flight with the new turn: paper bound ceil(1.5 x 4 / 2) = 3
    assert paper.pick(key, 0.0).outcome is PickOutcome.SPILL_OVER_BOUND
    assert floored.pick(key, 0.0).outcome is PickOutcome.HOME
    floored.set_engine_load(home, 8)
    assert floored.pick(key, 0.0).outcome is PickOutcome.SPILL_OVER_BOUND
