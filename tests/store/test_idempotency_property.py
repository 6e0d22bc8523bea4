"""Property: under any interleaving of concurrent claims, finishes, fails and lease expiries, every turn id is
stored at most once, the conversation's messages stay dense and paired, and usage counts each stored turn
once (invariant I2)."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatmesh.mesh.errors import FailedPrecondition
from chatmesh.mesh.ids import LeaseId, OwnerId, TurnId
from chatmesh.store.core import ConversationStore
from chatmesh.store.values import Claimed, MessageStatus, Reply, Role, TurnRecordState, Usage
from tests.store.conftest import FakeClock

TTL = 1000
Op = tuple[int, str]
ops = st.tuples(st.integers(0, 2), st.sampled_from(["begin", "begin", "finish", "fail"]))
schedules = st.lists(st.tuples(st.lists(ops, min_size=1, max_size=6), st.booleans()), min_size=1, max_size=5)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=schedules)
async def test_turns_are_stored_at_most_once(store: ConversationStore, clock: FakeClock,
                                             schedule: list[tuple[list[Op], bool]]) -> None:
    owner = OwnerId(f"prop-{uuid.uuid4().hex[:8]}")  # fresh per example, so a failed example leaves no trace
    conv = (await store.conversations.insert_conversation(owner)).conversation_id
    turns = [TurnId(str(uuid.uuid4())) for _ in range(3)]
    leases: dict[int, list[LeaseId]] = {i: [] for i in range(3)}
    stored_by: Counter[int] = Counter()

    async def run(i: int, op: str) -> tuple[str, object]:
        turn = turns[i]
        if op == "begin":
            return op, await store.turns.begin_turn(owner, conv, turn, content=f"q{i}", lease_holder="p", lease_ttl_ms=TTL)
        if not leases[i]:
            return op, None
        try:
            if op == "finish":
                reply = Reply(1, f"a{i}", 1, MessageStatus.COMPLETE, Usage(3, 1, 1))
                return op, (await store.turns.finish_turn(owner, conv, turn, leases[i][-1], reply)).already_finished
            return op, await store.turns.fail_turn(owner, conv, turn, leases[i][-1])
        except FailedPrecondition:
            return op, "lease lost"

    for batch, expire_after in schedule:
        outcomes = await asyncio.gather(*[run(i, op) for i, op in batch])
        claims: Counter[int] = Counter()
        released: Counter[int] = Counter()
        for (i, _), (op, result) in zip(batch, outcomes):
            if op == "begin" and isinstance(result, Claimed):
                claims[i] += 1
                leases[i].append(result.lease_id)
            elif op == "finish" and result is False:
                stored_by[i] += 1
            elif op == "fail" and result is True:
                released[i] += 1
        for i, n in claims.items():
            assert n <= 1 + released[i], f"turn {i}: {n} claims in one batch"
        if expire_after:
            clock.advance(TTL + 1)

    assert all(n <= 1 for n in stored_by.values())
    history = await store.conversations.read_conversation(owner, conv)
    assert [m.index for m in history.messages] == list(range(len(history.messages)))
    states = {i: (await store.turns.read_turn(owner, conv, t)).state for i, t in enumerate(turns)
              if leases[i] or stored_by[i]}
    stored = {turns[i] for i, s in states.items() if s in (TurnRecordState.STORED, TurnRecordState.STOPPED)}
    assert stored == {turns[i] for i in stored_by}
    by_turn = Counter((m.turn_id, m.role) for m in history.messages)
    assert by_turn == Counter({(t, r): 1 for t in stored for r in (Role.USER, Role.ASSISTANT)})
    usage = await store.lifecycle.usage(owner)
    assert sum(d.turns for d in usage) == len(stored)
