"""The follow-the-KV policy: turns go where their prefix is while under the bound, no replica passes the bound
while another has room, membership changes move only what they must, and two routers agree."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatmesh.mesh.errors import Unavailable
from chatmesh.mesh.ids import ConversationId, LeaseId, ReplicaId
from chatmesh.router.follow import Follow, Placement
from chatmesh.router.ring import Pick, PickOutcome, Replica


def replicas(n: int) -> list[Replica]:
    return [Replica(ReplicaId(f"engine-{i}"), f"127.0.0.1:{50000 + i}") for i in range(n)]


def conv(i: int) -> ConversationId:
    return ConversationId(f"conversation-{i}")


def follow(n: int, eps: float = 0.2, hold_tokens: int = 1600, overshoot: float = 0.15, floor: int = 16) -> Follow:
    return Follow(replicas(n), eps=eps, hold_tokens=hold_tokens, overshoot=overshoot, min_spill_load=floor)


# An op: ("pick", conversation, excluded replica or -1) | ("release", nth open lease) |
# ("engine", replica, in-flight) | ("health", replica, serving) | ("report", replica, conversation, tokens) |
# ("full", replica, conversations listed with 1,000 tokens each)
_pick = st.tuples(st.just("pick"), st.integers(0, 12), st.sampled_from([-1, -1, -1, 0, 1, 2, 3, 4, 5]))
ops = st.lists(st.one_of(
    _pick, _pick, _pick,
    st.tuples(st.just("release"), st.integers(0, 1000)),
    st.tuples(st.just("engine"), st.integers(0, 5), st.integers(0, 30)),
    st.tuples(st.just("health"), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("report"), st.integers(0, 5), st.integers(0, 12), st.sampled_from([0, 0, 32, 900, 5000])),
    st.tuples(st.just("full"), st.integers(0, 5), st.lists(st.integers(0, 12), max_size=5)),
), min_size=40, max_size=250)


def apply(policy: Follow, op: tuple[object, ...], open_leases: list[LeaseId], n: int) -> Pick | None:
    """Runs one op; a pick returns its Pick (None when refused or not a pick)."""
    ids = [r.id for r in replicas(n)]
    ring = policy
    match op:
        case ("pick", int(c), int(x)):
            exclude = frozenset([ids[x]]) if 0 <= x < n else frozenset()
            try:
                pick = policy.pick(conv(c), 0.0, exclude)
            except Unavailable:
                return None
            open_leases.append(pick.lease_id)
            return pick
        case ("release", int(k)) if open_leases:
            ring.release(open_leases.pop(k % len(open_leases)))
        case ("engine", int(r), int(load)) if r < n:
            ring.set_engine_load(ids[r], load)
        case ("health", int(r), bool(up)) if r < n:
            ring.set_serving(ids[r], up)
        case ("report", int(r), int(c), int(tokens)) if r < n:
            policy.placement.report(ids[r], [(conv(c), tokens)])
        case ("full", int(r), list(cs)) if r < n:
            policy.placement.report(ids[r], [(conv(c), 1000) for c in cs], full=True)
        case _:
            pass
    return None


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 6), eps=st.sampled_from([0.0, 0.2, 0.5]), hold=st.sampled_from([0, 800]),
       floor=st.sampled_from([0, 0, 4]), script=ops)
def test_prefix_affinity_under_the_bound_and_never_over_it_while_another_has_room(
        n: int, eps: float, hold: int, floor: int, script: list[tuple[object, ...]]) -> None:
    policy = follow(n, eps=eps, hold_tokens=hold, overshoot=0.3, floor=floor)
    ring, placement = policy, policy.placement
    ids = [r.id for r in replicas(n)]
    open_leases: list[LeaseId] = []
    for op in script:
        if op[0] != "pick":
            apply(policy, op, open_leases, n)
            placement.check()
            continue
        c, x = op[1], op[2]
        assert isinstance(c, int) and isinstance(x, int)
        exclude = frozenset([ids[x]]) if 0 <= x < n else frozenset()
        serving = [r for r in ids if r in ring._serving]
        usable = [r for r in serving if r not in exclude]
        before = {r: ring.load(r) for r in ids}
        bound, cap = policy.bounds()
        home, held = placement.home(conv(c)), placement.held(conv(c))
        pick = apply(policy, op, open_leases, n)
        placement.check()
        if not usable:
            assert pick is None
            continue
        assert pick is not None
        chosen = pick.replica.id
        assert chosen in usable
        room = [r for r in usable if before[r] < bound]
        allowance = bound if not hold or home is None else min(cap, bound + held[home] // hold)
        # Under its allowance, a turn goes where its prefix is ...
        if home in usable and before[home] < allowance:
            assert chosen == home and pick.outcome is PickOutcome.HOME
        # ... never past the cap, and past the bound only to stay with a prefix it would lose ...
        if room:
            assert before[chosen] < (allowance if chosen == home else bound)
            assert ring.load(chosen) <= cap
        else:
            assert before[chosen] == min(before[r] for r in usable)  # everyone is full: the least loaded
        # ... and a turn that moves goes to the usable replica with most of its prefix, then the least loaded.
        if chosen != home and room:
            others = [r for r in room if r != home]
            if others:
                best = max(others, key=lambda r: (held.get(r, 0), -before[r]))
                assert (held.get(chosen, 0), -before[chosen]) == (held.get(best, 0), -before[best])
        # The outcome tells the truth, and the turn's replica is the conversation's home from now on.
        if home is None:
            assert pick.outcome is PickOutcome.PLACED and pick.home == chosen
        else:
            assert pick.home == home
            assert (pick.outcome is PickOutcome.HOME) == (chosen == home)
        assert placement.home(conv(c)) == chosen
    assert ring.open_leases == len(open_leases)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), script=ops)
def test_two_routers_fed_the_same_inputs_pick_the_same_replicas(n: int, script: list[tuple[object, ...]]) -> None:
    a, b = follow(n), Follow(list(reversed(replicas(n))))  # configured in another order
    leases_a: list[LeaseId] = []
    leases_b: list[LeaseId] = []
    for op in script:
        pa, pb = apply(a, op, leases_a, n), apply(b, op, leases_b, n)
        assert (pa is None) == (pb is None)
        if pa is not None and pb is not None:
            assert (pa.replica.id, pa.home, pa.outcome) == (pb.replica.id, pb.home, pb.outcome)


def _settle(policy: Follow, keys: list[ConversationId]) -> dict[ConversationId, ReplicaId]:
    """One turn per conversation, each released before the next: where every conversation lives."""
    where = {}
    for k in keys:
        pick = policy.pick(k, 0.0)
        policy.release(pick.lease_id)
        where[k] = pick.replica.id
    return where


def test_a_replica_leaving_moves_only_its_conversations_and_returning_takes_back_only_unmoved_ones() -> None:
    policy = follow(4)
    keys = [conv(i) for i in range(400)]
    homes = _settle(policy, keys)
    assert len(set(homes.values())) == 4  # first turns spread over the replicas
    down = ReplicaId("engine-2")
    policy.set_serving(down, False)
    moved_keys = [k for k in keys[:200] if homes[k] == down]  # half of its conversations have a turn meanwhile
    during = _settle(policy, keys[:200])
    for k in keys[:200]:
        assert (during[k] == homes[k]) == (homes[k] != down)
    policy.set_serving(down, True)
    after = _settle(policy, keys)
    for k in keys:
        # moved conversations stay where their prefix now is; everyone else is where it always was
        assert after[k] == (during[k] if k in moved_keys else homes[k])


def test_an_evicted_prefix_frees_the_turn_to_go_where_load_is_lowest() -> None:
    policy = follow(3, floor=0)
    key = conv(1)
    first = policy.pick(key, 0.0)
    policy.release(first.lease_id)
    assert first.outcome is PickOutcome.PLACED
    home = first.replica.id
    policy.placement.report(home, [(key, 3000)])
    policy.set_engine_load(home, 9)  # far over the bound: the turn must move, a spill (it loses 3000)
    spilled = policy.pick(key, 0.0)
    assert spilled.outcome is PickOutcome.SPILL_OVER_BOUND and spilled.replica.id != home
    policy.release(spilled.lease_id)
    assert policy.placement.home(key) == spilled.replica.id  # the conversation moved with its turn
    for r in replicas(3):
        policy.placement.report(r.id, [(key, 0)])  # then evicted everywhere: nothing left to lose
    pick = policy.pick(key, 0.0)
    assert pick.outcome is PickOutcome.PLACED and pick.replica.id != home


def test_overshoot_keeps_a_long_prefix_home_a_little_past_the_bound() -> None:
    policy = follow(3, eps=0.0, hold_tokens=1000, overshoot=1.0, floor=0)
    ring, key = policy, conv(1)
    first = policy.pick(key, 0.0)
    ring.release(first.lease_id)
    home = first.replica.id
    policy.placement.report(home, [(key, 2500)])  # 2500 // 1000: up to two sequences over the bound
    ring.set_engine_load(home, 1)
    assert policy.bounds() == (1, 2)  # 2 in flight with the incoming turn over 3: B = ceil(2/3), C = ceil(4/3)
    pick = policy.pick(key, 0.0)  # over B, under its allowance min(C, B + 2) = 2
    assert pick.outcome is PickOutcome.HOME
    ring.release(pick.lease_id)
    ring.set_engine_load(home, 2)
    assert policy.bounds() == (1, 2)
    moved = policy.pick(key, 0.0)
    assert moved.outcome is PickOutcome.SPILL_OVER_BOUND  # at the cap: it moves
    ring.release(moved.lease_id)
    ring.set_engine_load(home, 0)
    short = conv(2)
    first = policy.pick(short, 0.0)
    ring.release(first.lease_id)
    policy.placement.report(first.replica.id, [(short, 500)])  # too little cached to buy any overshoot
    ring.set_engine_load(first.replica.id, 1)
    assert policy.bounds()[0] == 1
    assert policy.pick(short, 0.0).outcome is PickOutcome.SPILL_OVER_BOUND


def test_idle_replicas_keep_consecutive_turns_home_even_with_stale_load_reports() -> None:
    """The issue's smoke case: three idle sim replicas, one conversation, turn after turn. The engine still
    reports the last turn in flight and chat has not released its lease yet: the default floor keeps it home."""
    policy = Follow(replicas(3))
    key = conv(9)
    first = policy.pick(key, 0.0)
    home = first.replica.id
    for _ in range(8):
        policy.set_engine_load(home, 1)
        pick = policy.pick(key, 1.0)  # the previous lease still open
        assert pick.replica.id == home and pick.outcome is PickOutcome.HOME
        policy.release(first.lease_id)
        first = pick


def test_placement_full_listing_replaces_and_the_table_is_bounded() -> None:
    placement = Placement(max_conversations=3)
    a, b = ReplicaId("a"), ReplicaId("b")
    placement.report(a, [(conv(1), 100), (conv(2), 100)])
    placement.report(b, [(conv(1), 300)])
    assert placement.home(conv(1)) == b and placement.home(conv(2)) == a
    placement.report(b, [(conv(3), 50)], full=True)  # b restarted its listing: conv 1 is only on a now
    assert placement.home(conv(1)) == a and placement.held(conv(1)) == {a: 100}
    placement.report(a, [(conv(1), 0)])
    assert placement.home(conv(1)) is None
    for i in range(10, 20):
        placement.picked(conv(i), a)
    assert len(placement) == 3 and placement.home(conv(19)) == a and placement.home(conv(10)) is None
    placement.check()
    placement.drop_replica(a)
    assert len(placement) == 0
    placement.check()


def test_no_serving_replica_is_unavailable() -> None:
    with pytest.raises(Unavailable, match="no replica is configured"):
        Follow().pick(conv(1), 0.0)
    policy = follow(2)
    for r in replicas(2):
        policy.set_serving(r.id, False)
    with pytest.raises(Unavailable, match="none of 2 replicas is serving"):
        policy.pick(conv(1), 0.0)
    policy.set_serving(ReplicaId("engine-0"), True)
    with pytest.raises(Unavailable, match="excluded"):
        policy.pick(conv(1), 0.0, frozenset([ReplicaId("engine-0")]))
