"""The follow policy with pulls (issue 29): a move never pays more than recompute by the policy's own cost
model, never names a source that cannot serve (or a target that cannot receive, or unequal layouts), and with
pulls on no replica passes the bound while another has room; a draining home is the source of its turns' moves;
a router that restarts, or a second router, rebuilds the same placement from the engines' reports."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from chatmesh.mesh.ids import ConversationId, LeaseId, ReplicaId
from chatmesh.router.follow import Follow
from chatmesh.router.link import DEFAULT_COST, Link, PrefixCost
from chatmesh.router.ring import PickOutcome
from tests.router.test_follow import apply, conv, ops, replicas


def pulling(n: int, eps: float = 0.2, pull_eps: float = 0.05, hold_tokens: int = 1600, floor: int = 0,
            cost: PrefixCost = DEFAULT_COST) -> Follow:
    return Follow(replicas(n), eps=eps, pull_eps=pull_eps, hold_tokens=hold_tokens, overshoot=0.15,
                  min_spill_load=floor, pulls=cost)


# reports with realistic prefix sizes (up to 32k tokens: a pull of that costs ~17 ms, under one hold_tokens of
# prefill, so with pulls the overshoot never applies) and pull roles changing under the policy
roles = st.tuples(st.just("roles"), st.integers(0, 5), st.booleans(), st.booleans(), st.sampled_from(["a", "a", "b"]))
sized_reports = st.tuples(st.just("report"), st.integers(0, 5), st.integers(0, 12),
                          st.sampled_from([0, 16, 200, 3000, 9000, 32000]))
script_with_roles = st.tuples(ops, st.lists(st.one_of(roles, sized_reports), max_size=60)).flatmap(
    lambda pair: st.permutations(pair[0] + pair[1]))


def run_op(policy: Follow, op: tuple[object, ...], leases: list[LeaseId], n: int) -> None:
    ids = [r.id for r in replicas(n)]
    match op:
        case ("roles", int(r), bool(serves), bool(receives), str(layout)) if r < n:
            policy.set_pulls(ids[r], serves, receives, layout)
        case _:
            apply(policy, op, leases, n)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(2, 6), slow_link=st.booleans(), script=script_with_roles)
def test_a_move_never_pays_more_than_recompute_and_names_only_usable_sources(
        n: int, slow_link: bool, script: list[tuple[object, ...]]) -> None:
    # a slow link (20 GB/s, 20 ms a transfer) makes pulls under ~1,400 tokens cost more than prefill: they must
    # not be planned
    cost = PrefixCost(Link(20e9, 0.02), DEFAULT_COST.kv_bytes_per_token, DEFAULT_COST.prefill_tokens_per_s) \
        if slow_link else DEFAULT_COST
    policy = pulling(n, cost=cost)
    ids = [r.id for r in replicas(n)]
    leases: list[LeaseId] = []
    for op in script:
        if op[0] != "pick":
            run_op(policy, op, leases, n)
            continue
        c, x = op[1], op[2]
        assert isinstance(c, int) and isinstance(x, int)
        exclude = frozenset([ids[x]]) if 0 <= x < n else frozenset()
        held = policy.placement.held(conv(c))
        roles = {r: policy.pull_roles(r) for r in ids}
        layouts = dict(policy._layouts)
        pick = apply(policy, op, leases, n)
        if pick is None:
            continue
        chosen = pick.replica.id
        own = held.get(chosen, 0)
        top = max(held.values(), default=0)
        if pick.source is None:
            assert pick.source_tokens == 0
            # no source: none could serve a pull worth its cost
            for r, tokens in held.items():
                if r != chosen and roles[r][0] and r not in exclude and roles[chosen][1] and \
                        layouts.get(r) == layouts.get(chosen):
                    assert not cost.worth_pulling(tokens - own)
            continue
        source = pick.source.id
        assert source != chosen and source not in exclude
        assert roles[source][0] and roles[chosen][1] and layouts.get(source) == layouts.get(chosen)
        assert pick.source_tokens == held[source] > own
        pulled = pick.source_tokens - own
        # the pull is cheaper than prefilling what it brings, and the whole move no dearer than recompute
        assert cost.pull_s(pulled) < cost.prefill_s(pulled)
        plan_s = cost.pull_s(pulled) + cost.prefill_s(top - pick.source_tokens)
        assert plan_s <= cost.prefill_s(top - own) + 1e-12
        assert pick.source_tokens == max(t for r, t in held.items() if roles[r][0] and r not in exclude and
                                         r != chosen and layouts.get(r) == layouts.get(chosen))


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 6), pull_eps=st.sampled_from([0.0, 0.05, 0.2]), floor=st.sampled_from([0, 0, 4]),
       script=st.tuples(ops, st.lists(sized_reports, max_size=40)).flatmap(
           lambda pair: st.permutations(pair[0] + pair[1])))
def test_with_pulls_no_replica_exceeds_the_bound_while_another_has_room(
        n: int, pull_eps: float, floor: int, script: list[tuple[object, ...]]) -> None:
    policy = pulling(n, pull_eps=pull_eps, floor=floor)
    ids = [r.id for r in replicas(n)]
    leases: list[LeaseId] = []
    for op in script:
        if op[0] != "pick":
            apply(policy, op, leases, n)
            policy.placement.check()
            continue
        c, x = op[1], op[2]
        assert isinstance(c, int) and isinstance(x, int)
        exclude = frozenset([ids[x]]) if 0 <= x < n else frozenset()
        usable = [r for r in ids if r in policy._serving and r not in exclude]
        before = {r: policy.load(r) for r in ids}
        held = policy.placement.held(conv(c))
        home = policy.placement.home(conv(c))
        # every replica serves and receives pulls here (a not serving one is draining), so any prefix a
        # replica caches can follow a move unless the caller excluded it
        pullable = any(r not in exclude for r in held)
        assert pullable == policy.pullable(conv(c), exclude)
        bound, _ = policy.bounds(pullable)
        pick = apply(policy, op, leases, n)
        if pick is None:
            assert not usable
            continue
        chosen = pick.replica.id
        room = [r for r in usable if before[r] < bound]
        if room:
            assert before[chosen] < bound, (chosen, before, bound)
        else:
            assert before[chosen] == min(before[r] for r in usable)
        if pick.source is not None:
            assert pick.source.id in held and held[pick.source.id] == max(
                t for r, t in held.items() if r != chosen and r not in exclude)
        if home is not None and home in usable and before[home] < bound:
            assert chosen == home and pick.outcome is PickOutcome.HOME


def test_a_draining_home_is_the_source_of_its_conversations_next_turns() -> None:
    policy = pulling(3)
    a, b, c = (r.id for r in replicas(3))
    key = ConversationId("conversation-drain")
    first = policy.pick(key, 0.0)
    policy.release(first.lease_id)
    home = first.replica.id
    policy.placement.report(home, [(key, 3000)])
    policy.set_serving(home, False)  # SIGTERM: no new turns, still serves pulls
    moved = policy.pick(key, 1.0)
    assert moved.outcome is PickOutcome.SPILL_HOME_DRAINING and moved.home == home
    assert moved.replica.id != home and moved.source is not None and moved.source.id == home
    assert moved.source_tokens == 3000
    # the grace ends: the old home no longer serves pulls, and it is not named again
    policy.set_pulls(home, False, True)
    other = ConversationId("conversation-drain-2")
    policy.placement.report(home, [(other, 3000)])
    gone = policy.pick(other, 2.0)
    assert gone.outcome is PickOutcome.SPILL_HOME_DOWN and gone.source is None
    assert {a, b, c} >= {moved.replica.id, gone.replica.id}


def test_a_move_to_a_replica_that_cannot_pull_prefills_and_a_long_prefix_waits_at_home_instead() -> None:
    policy = pulling(2, pull_eps=0.0, hold_tokens=1600, floor=0)
    a, b = (r.id for r in replicas(2))
    key = ConversationId("conversation-triton")
    policy.placement.report(a, [(key, 6400)])
    policy.set_pulls(b, False, False)  # b cannot receive: a move there would prefill all 6,400 tokens
    policy.set_engine_load(a, 3)
    policy.set_engine_load(b, 2)
    pick = policy.pick(key, 0.0)
    # a move costs 6,400 prefill tokens = 4 x hold_tokens: the turn stays home past the tight bound
    assert pick.replica.id == a and pick.outcome is PickOutcome.HOME and pick.source is None
    policy.set_pulls(b, True, True)
    policy.release(pick.lease_id)
    pick = policy.pick(key, 0.0)
    # b can pull now: the move costs a ~2.7 ms pull, so the tight bound applies and the turn moves with its prefix
    assert pick.replica.id == b and pick.source is not None and pick.source.id == a
    assert pick.source_tokens == 6400 and pick.outcome is PickOutcome.SPILL_OVER_BOUND


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 6), script=st.tuples(ops, st.lists(sized_reports, max_size=40)).flatmap(
    lambda pair: st.permutations(pair[0] + pair[1])))
def test_a_restarted_router_rebuilds_the_placement_from_full_listings(n: int, script: list[tuple[object, ...]]
                                                                     ) -> None:
    """What the engines list (each a full listing, as a new WatchStats stream starts) is all a router needs:
    a fresh one fed those listings holds the same homes and picks the same replicas and sources as one that
    saw every pick and report since the start."""
    old = pulling(n)
    leases: list[LeaseId] = []
    ids = [r.id for r in replicas(n)]
    for op in script:
        apply(old, op, leases, n)
    for lease in leases:
        old.release(lease)
    # the engines' truth: each replica caches what the old router's table says (its picks have been reported)
    listing = {r: [(conv(c), t) for c in range(13) if (t := old.placement.held(conv(c)).get(r, 0)) > 0]
               for r in ids}
    for r in ids:
        old.placement.report(r, listing[r], full=True)
    new = pulling(n)
    for r in reversed(ids):
        new.placement.report(r, listing[r], full=True)
    for c in range(13):
        assert new.placement.home(conv(c)) == old.placement.home(conv(c))
    for r in ids:  # the same loads on both
        old.set_serving(r, True)
        new.set_serving(r, True)
        old.set_engine_load(r, 3 * ids.index(r))
        new.set_engine_load(r, 3 * ids.index(r))
    for c in range(13):
        p, q = old.pick(conv(c), 0.0), new.pick(conv(c), 0.0)
        assert (p.replica.id, p.home, p.outcome, p.source, p.source_tokens) == (
            q.replica.id, q.home, q.outcome, q.source, q.source_tokens)
