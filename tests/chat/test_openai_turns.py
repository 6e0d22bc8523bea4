"""What the OpenAI-compatible surface asks of the chat core, on in-memory ports (tests/chat/fakes.py): per-turn
options reaching the engine, stop strings cutting the reply (neither sent nor stored), a send that creates its
conversation with a client's history, the expect_last_turn_id guard, per-turn instructions, and GetTurn /
DeleteTurn."""

from __future__ import annotations

import uuid

import pytest

from chatmesh.chat.events import Blocked, Completed
from chatmesh.chat.ports import FinishReason
from chatmesh.chat.options import TurnOptions
from chatmesh.chat.turns import NewConversation
from chatmesh.mesh import errors
from chatmesh.mesh.ids import ConversationId, TurnId
from chatmesh.mesh.turn import TurnRecordState
from chatmesh.store.values import MessageStatus, Role, Seed
from tests.chat.fakes import reply_script
from tests.chat.test_core import OWNER, collect, fresh, stored, text_of, world


def new_turn() -> TurnId:
    return TurnId(str(uuid.uuid4()))


async def test_turn_options_reach_the_engine_within_the_cap() -> None:
    w, conv = await fresh()
    await collect(w.core.send_turn(OWNER, conv, new_turn(), "Hi", TurnOptions(temperature=0.7, top_p=0.5, seed=9,
                                                                             max_tokens=1000)))
    g = w.engine.generations[-1]
    assert (round(g.temperature, 3), round(g.top_p, 3), g.seed, g.max_tokens) == (0.7, 0.5, 9, 64)  # cap 64
    await collect(w.core.send_turn(OWNER, conv, new_turn(), "Hi", TurnOptions(max_tokens=5)))
    assert w.engine.generations[-1].max_tokens == 5
    await collect(w.core.send_turn(OWNER, conv, new_turn(), "Hi"))
    g = w.engine.generations[-1]
    assert (g.temperature, g.top_p, g.seed, g.max_tokens) == (0.0, 1.0, 0, 64)  # the configured defaults


@pytest.mark.parametrize("chunks, stop, sent", [
    (("Hello wor", "ld. STOP here", " and more"), ("STOP",), "Hello world. "),
    (("one ST", "OP two",), ("STOP",), "one "),  # the stop string split across two chunks
    (("a b", " c"), ("zz", "b c"), "a "),
    (("nothing", " stops"), ("zz",), "nothing stops"),
])
async def test_stop_strings_end_the_reply_before_them(chunks: tuple[str, ...], stop: tuple[str, ...],
                                                      sent: str) -> None:
    w, conv = await fresh()
    w.engine.scripts.append(reply_script(*chunks))
    events = await collect(w.core.send_turn(OWNER, conv, new_turn(), "Go", TurnOptions(stop=stop)))
    await w.settled()
    assert text_of(events) == sent
    final = events[-1].kind
    assert isinstance(final, Completed) and final.finish_reason == "stop"
    assert stored(w, conv)[-1] == (Role.ASSISTANT, sent, MessageStatus.COMPLETE)


async def test_a_send_creates_its_conversation_with_the_clients_history() -> None:
    w = world()
    conv = ConversationId(str(uuid.uuid4()))
    seed = (Seed(Role.SYSTEM, "Be terse."), Seed(Role.USER, "Earlier question"), Seed(Role.ASSISTANT, "Earlier reply"))
    turn = new_turn()
    events = await collect(w.core.send_turn(OWNER, conv, turn, "New question", create=NewConversation("", seed)))
    assert isinstance(events[-1].kind, Completed)
    assert [c for _, c, _ in stored(w, conv)] == ["Be terse.", "Earlier question", "Earlier reply", "New question",
                                                  "Hello there."]
    assert [m.token_count for m in w.store.conversations[(OWNER, conv)].messages[:3]] == [2, 2, 2]
    # a retry of the same request finds the conversation and replays the turn (nothing seeded again)
    again = await collect(w.core.send_turn(OWNER, conv, turn, "New question", create=NewConversation("", seed)))
    assert text_of(again) == "Hello there." and len(stored(w, conv)) == 5 and len(w.engine.generations) == 1


async def test_a_seeded_historys_user_messages_pass_the_input_check_as_create_conversations_do() -> None:
    """One seed policy for both entry points (CreateConversation's messages, a send's NewConversation): a blocked
    user message refuses the request, naming it, and nothing is stored; had the seed been stored and only the turn
    blocked, the blocked message would reach the engine, unchecked, in the next turn's prompt."""
    w = world()
    conv = ConversationId(str(uuid.uuid4()))
    seed = (Seed(Role.SYSTEM, "BLOCKME is fine in a system prompt"), Seed(Role.USER, "earlier: please BLOCKME"),
            Seed(Role.ASSISTANT, "Earlier reply"))
    with pytest.raises(errors.InvalidArgument, match=r"messages\[1\] was blocked by moderation \(abuse\)"):
        await collect(w.core.send_turn(OWNER, conv, new_turn(), "Innocent question",
                                       create=NewConversation("", seed)))
    await w.settled()
    assert (OWNER, conv) not in w.store.conversations and not w.store.records  # nothing stored
    assert len(w.engine.generations) == 0 and w.idle()
    assert w.moderation.inputs_checked == 1  # the seeded user message (not the system prompt); no turn began
    # a clean history: every user message checked, the turn answered
    clean = ConversationId(str(uuid.uuid4()))
    ok = await collect(w.core.send_turn(OWNER, clean, new_turn(), "Next", create=NewConversation("", (
        Seed(Role.USER, "one"), Seed(Role.ASSISTANT, "r1"), Seed(Role.USER, "two"), Seed(Role.ASSISTANT, "r2")))))
    assert isinstance(ok[-1].kind, Completed) and w.moderation.inputs_checked == 4
    # an ordinary send checks its one message, as before
    await collect(w.core.send_turn(OWNER, clean, new_turn(), "Third"))
    assert w.moderation.inputs_checked == 5


async def test_expect_last_turn_id_refuses_a_history_that_moved_on() -> None:
    w, conv = await fresh()
    first, second = new_turn(), new_turn()
    await collect(w.core.send_turn(OWNER, conv, first, "One"))
    await collect(w.core.send_turn(OWNER, conv, second, "Two", expect_last=first))
    assert len(stored(w, conv)) == 4
    late = new_turn()
    with pytest.raises(errors.FailedPrecondition):
        await collect(w.core.send_turn(OWNER, conv, late, "Branch from one", expect_last=first))
    await w.settled()
    assert len(stored(w, conv)) == 4 and len(w.engine.generations) == 2  # nothing stored, nothing generated
    assert w.store.records[w.key(conv, late)].state is TurnRecordState.FAILED
    assert w.idle()
    # a retry of a stored turn replays whatever it expects
    replayed = await collect(w.core.send_turn(OWNER, conv, second, "Two", expect_last=first))
    assert text_of(replayed) == "Hello there." and len(w.engine.generations) == 2


async def test_instructions_apply_to_their_turn_and_are_not_repeated() -> None:
    w = world()
    conv = ConversationId(str(uuid.uuid4()))
    await collect(w.core.send_turn(OWNER, conv, new_turn(), "Hi", TurnOptions(instructions="Be terse."),
                                   create=NewConversation("", (Seed(Role.SYSTEM, "Be terse."),))))
    same = w.engine.generations[-1].prompt_token_ids
    assert same.count(1) == 2  # the platform prompt and the conversation's own instructions: not added again
    await collect(w.core.send_turn(OWNER, conv, new_turn(), "More", TurnOptions(instructions="Use French now.")))
    other = w.engine.generations[-1].prompt_token_ids
    assert other.count(1) == 3 and other[:len(same) - 1] == same[:-1]  # after the stable prefix, before "More"
    await collect(w.core.send_turn(OWNER, conv, new_turn(), "Again"))
    assert w.engine.generations[-1].prompt_token_ids.count(1) == 2  # never stored: gone from later prompts


async def test_get_and_delete_a_turn() -> None:
    w, conv = await fresh()
    turn, regen = new_turn(), new_turn()
    await collect(w.core.send_turn(OWNER, conv, turn, "Question"))
    await collect(w.core.regenerate(OWNER, conv, regen))
    record = await w.core.get_turn(OWNER, conv, turn)
    assert record.state is TurnRecordState.STORED and record.reply is not None
    with pytest.raises(errors.NotFound):
        await w.core.get_turn(OWNER, conv, new_turn())
    evicted = await w.core.delete_turn(OWNER, conv, turn)
    assert evicted == 1 and stored(w, conv) == [] and w.engine.evicted[-1][-1] == conv
    with pytest.raises(errors.NotFound):
        await w.core.get_turn(OWNER, conv, regen)


async def test_completed_says_why_the_reply_ended() -> None:
    w, conv = await fresh()
    w.engine.scripts.append(reply_script("cut", " off", reason=FinishReason.LENGTH))
    cut = (await collect(w.core.send_turn(OWNER, conv, new_turn(), "Hi")))[-1].kind
    ended = (await collect(w.core.send_turn(OWNER, conv, new_turn(), "Hi")))[-1].kind
    assert isinstance(cut, Completed) and cut.finish_reason == "length"
    assert isinstance(ended, Completed) and ended.finish_reason == "stop"


async def test_a_conversation_created_with_messages_input_checks_their_user_messages() -> None:
    """CreateConversation with messages (the Conversations API's items): each user message passes the input
    check as it would as a turn; one blocked refuses the whole creation, naming it, and nothing is stored."""
    w = world()
    before = dict(w.store.conversations)
    with pytest.raises(errors.InvalidArgument, match=r"messages\[1\] was blocked by moderation \(abuse\)"):
        await w.core.create_conversation(OWNER, "", (Seed(Role.SYSTEM, "BLOCKME in a system prompt is not checked"),
                                                     Seed(Role.USER, "please BLOCKME")))
    assert w.store.conversations == before and w.moderation.inputs_checked == 1
    made = await w.core.create_conversation(OWNER, "", (Seed(Role.USER, "Remember 7."),
                                                        Seed(Role.ASSISTANT, "Noted.")))
    assert w.moderation.inputs_checked == 2
    assert [c for _, c, _ in stored(w, made.conversation_id)] == ["Remember 7.", "Noted."]
