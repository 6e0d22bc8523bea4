"""What the OpenAI-compatible surface needs of the store: a conversation created under a given id with a client's
history (idempotent, owner-scoped), and the deletion of one turn (a response) with its regenerations."""

from __future__ import annotations

import uuid

import pytest

from chatmesh.mesh.errors import FailedPrecondition, InvalidArgument, NotFound
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId
from chatmesh.store.core import ConversationStore
from chatmesh.store.values import Claimed, Role, Seed
from tests.store.test_turns import OWNER, claim, conversation, new_turn, reply

SEED = [Seed(Role.SYSTEM, "Be brief.", 3), Seed(Role.USER, "Hi", 1), Seed(Role.ASSISTANT, "Hello!", 2)]


async def test_seeded_conversation_holds_the_history_and_a_retry_finds_it(store: ConversationStore) -> None:
    conv = ConversationId(str(uuid.uuid4()))
    made, created = await store.conversations.create_conversation(OWNER, conversation=conv, seed=SEED)
    assert created and made.conversation_id == conv and made.message_count == 3
    again, created_again = await store.conversations.create_conversation(OWNER, conversation=conv, seed=[Seed(Role.USER, "x")])
    assert not created_again and again.conversation_id == conv
    history = await store.conversations.read_conversation(OWNER, conv)
    assert [(m.index, m.role, m.content, m.token_count) for m in history.messages] == [
        (0, Role.SYSTEM, "Be brief.", 3), (1, Role.USER, "Hi", 1), (2, Role.ASSISTANT, "Hello!", 2)]
    assert len({m.turn_id for m in history.messages}) == 3
    # the next turn is stored after the seed
    turn = new_turn()
    claimed = await claim(store, conv, turn, "And now?")
    assert isinstance(claimed, Claimed)
    await store.turns.finish_turn(OWNER, conv, turn, claimed.lease_id, reply())
    assert [m.index for m in (await store.conversations.read_conversation(OWNER, conv)).messages] == [0, 1, 2, 3, 4]


async def test_another_owners_id_is_theirs(store: ConversationStore) -> None:
    conv = ConversationId(str(uuid.uuid4()))
    await store.conversations.create_conversation(OWNER, conversation=conv, seed=SEED)
    other, created = await store.conversations.create_conversation(OwnerId("bob"), conversation=conv)
    assert created and other.message_count == 0
    assert (await store.conversations.read_conversation(OwnerId("bob"), conv)).messages == []


async def test_bad_seed_is_refused_and_stores_nothing(store: ConversationStore) -> None:
    conv = ConversationId(str(uuid.uuid4()))
    with pytest.raises(InvalidArgument, match=r"messages\[1\]"):
        await store.conversations.create_conversation(OWNER, conversation=conv, seed=[SEED[0], Seed(Role.USER, "")])
    with pytest.raises(NotFound):
        await store.conversations.read_conversation(OWNER, conv)


async def test_delete_turn_removes_it_and_its_regenerations(store: ConversationStore) -> None:
    conv = await conversation(store)
    first, second = new_turn(), new_turn()
    for turn, text in ((first, "one"), (second, "two")):
        claimed = await claim(store, conv, turn, text)
        assert isinstance(claimed, Claimed)
        await store.turns.finish_turn(OWNER, conv, turn, claimed.lease_id, reply())
    again = new_turn()
    claimed = await store.turns.begin_turn(OWNER, conv, again, content="", lease_holder="chat-1", regenerates=second)
    assert isinstance(claimed, Claimed)
    await store.turns.finish_turn(OWNER, conv, again, claimed.lease_id, reply("hello again"))
    evict, deleted = await store.lifecycle.delete_turn(OWNER, conv, second)
    assert evict == [conv] and deleted == 3  # the user message, its reply and the regenerated reply
    left = (await store.conversations.read_conversation(OWNER, conv)).messages
    assert [m.turn_id for m in left] == [first, first]
    with pytest.raises(NotFound):
        await store.turns.read_turn(OWNER, conv, again)
    with pytest.raises(NotFound):
        await store.lifecycle.delete_turn(OWNER, conv, second)
    with pytest.raises(NotFound):  # another owner's turn: not found, never a hint
        await store.lifecycle.delete_turn(OwnerId("bob"), conv, first)


async def test_a_running_turn_is_not_deleted(store: ConversationStore) -> None:
    conv = await conversation(store)
    turn = new_turn()
    assert isinstance(await claim(store, conv, turn), Claimed)
    with pytest.raises(FailedPrecondition):
        await store.lifecycle.delete_turn(OWNER, conv, turn)
