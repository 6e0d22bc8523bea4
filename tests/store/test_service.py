"""StoreService over real gRPC on loopback (embedded SQLite and PostgreSQL): the turn cycle and status codes."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest

from chatmesh.mesh.config import Config
from chatmesh.mesh import identity
from chatmesh.mesh.server import serve
from chatmesh.store.service import build
from chatmesh.v1 import common_pb2, store_pb2, store_pb2_grpc

if TYPE_CHECKING:
    from chatmesh.v1.store_pb2_grpc import StoreServiceAsyncStub as Stub
from tests.conftest import free_port
from tests.trust import channel_as, trust_as
from tests.store.conftest import Backend



@contextlib.asynccontextmanager
async def serving(backend: Backend, tmp_path: Path, mesh_certs: Path) -> AsyncIterator[Stub]:
    """The store over mutual TLS, called as chat with a valid owner token for each request's owner; stopped (every
    call it was serving ended) on exit."""
    env = {"CHATMESH_DATA_DIR": str(tmp_path / "data"), "CHATMESH_MAX_MESSAGE_BYTES": "1000",
           "CHATMESH_STORE_PURGE_INTERVAL_S": "0"}
    if backend.schema is not None:
        env["CHATMESH_DATABASE_URL"] = backend.url
        env["CHATMESH_DATABASE_SCHEMA"] = backend.schema
    address = f"127.0.0.1:{free_port()}"
    ready, stop = asyncio.Event(), asyncio.Event()
    trust = trust_as(mesh_certs, identity.STORE)
    task = asyncio.create_task(serve(build(Config(env=env), trust), address, 0.5, ready=ready, stop=stop,
                                     trust=trust))
    await asyncio.wait_for(ready.wait(), 20)
    try:
        async with channel_as(mesh_certs, identity.CHAT, address, "store", owner_tokens=True) as channel:
            yield store_pb2_grpc.StoreServiceStub(channel)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@pytest.fixture
async def stub(backend: Backend, tmp_path: Path, mesh_certs: Path) -> AsyncIterator[Stub]:
    async with serving(backend, tmp_path, mesh_certs) as served:
        yield served


async def new_conversation(stub: Stub, owner: str = "alice") -> str:
    made = await stub.InsertConversation(store_pb2.InsertConversationRequest(
        owner_id=owner, title="hello", system_prompt_version="v1"))
    assert made.conversation.owner_id == owner and made.conversation.title == "hello"
    return made.conversation.conversation_id


async def code_of(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call  # type: ignore[misc]
    return err.value.code(), err.value.details() or ""


async def test_turn_cycle(stub: Stub) -> None:
    conv = await new_conversation(stub)
    turn = str(uuid.uuid4())
    begin = store_pb2.BeginTurnRequest(owner_id="alice", conversation_id=conv, turn_id=turn, fingerprint="f1",
                                       content="hi there", lease_holder="chat-1", lease_ttl_ms=10_000)
    first = await stub.BeginTurn(begin)
    assert first.WhichOneof("outcome") == "claimed" and first.claimed.lease_id
    again = await stub.BeginTurn(begin)
    assert again.WhichOneof("outcome") == "in_progress" and again.in_progress.lease_holder == "chat-1"
    other = store_pb2.BeginTurnRequest()
    other.CopyFrom(begin)
    other.fingerprint = "f2"
    conflict = await stub.BeginTurn(other)
    assert conflict.WhichOneof("outcome") == "conflict" and conflict.conflict.stored_fingerprint == "f1"
    finish = store_pb2.FinishTurnRequest(
        owner_id="alice", conversation_id=conv, turn_id=turn, lease_id=first.claimed.lease_id, user_token_count=2,
        reply="hello!", reply_token_count=3, reply_status=common_pb2.MESSAGE_STATUS_COMPLETE,
        usage=common_pb2.Usage(prompt_tokens=20, cached_prompt_tokens=5, output_tokens=3))
    done = await stub.FinishTurn(finish)
    assert not done.already_finished and done.reply.content == "hello!" and done.reply.index == 1
    assert (await stub.FinishTurn(finish)).already_finished
    replay = await stub.BeginTurn(begin)
    assert replay.WhichOneof("outcome") == "done"
    assert replay.done.reply.content == "hello!" and replay.done.usage.prompt_tokens == 20
    read = await stub.ReadConversation(store_pb2.ReadConversationRequest(owner_id="alice", conversation_id=conv))
    assert [(m.role, m.content) for m in read.messages] == [
        (common_pb2.ROLE_USER, "hi there"), (common_pb2.ROLE_ASSISTANT, "hello!")]


async def test_fail_then_retry(stub: Stub) -> None:
    conv = await new_conversation(stub)
    turn = str(uuid.uuid4())
    begin = store_pb2.BeginTurnRequest(owner_id="alice", conversation_id=conv, turn_id=turn, content="hi",
                                       lease_holder="chat-1")
    lease = (await stub.BeginTurn(begin)).claimed.lease_id
    failed = await stub.FailTurn(store_pb2.FailTurnRequest(owner_id="alice", conversation_id=conv, turn_id=turn,
                                                           lease_id=lease, reason="engine lost"))
    assert failed.released
    assert (await stub.BeginTurn(begin)).WhichOneof("outcome") == "claimed"
    code, _ = await code_of(stub.FinishTurn(store_pb2.FinishTurnRequest(
        owner_id="alice", conversation_id=conv, turn_id=turn, lease_id=lease, reply="x")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION


async def test_status_codes(stub: Stub) -> None:
    conv = await new_conversation(stub)
    cases: list[tuple[object, grpc.StatusCode, str]] = [
        (stub.ReadConversation(store_pb2.ReadConversationRequest(owner_id="alice", conversation_id="nope")),
         grpc.StatusCode.INVALID_ARGUMENT, "conversation_id"),
        (stub.ReadConversation(store_pb2.ReadConversationRequest(owner_id="", conversation_id=conv)),
         grpc.StatusCode.INVALID_ARGUMENT, "owner_id"),
        (stub.ReadConversation(store_pb2.ReadConversationRequest(owner_id="mallory", conversation_id=conv)),
         grpc.StatusCode.NOT_FOUND, "not found"),
        (stub.ReadConversation(store_pb2.ReadConversationRequest(owner_id="alice",
                                                                 conversation_id=str(uuid.uuid4()))),
         grpc.StatusCode.NOT_FOUND, "not found"),
        (stub.BeginTurn(store_pb2.BeginTurnRequest(owner_id="alice", conversation_id=conv, turn_id="bad",
                                                   content="hi")),
         grpc.StatusCode.INVALID_ARGUMENT, "turn_id"),
        (stub.BeginTurn(store_pb2.BeginTurnRequest(owner_id="alice", conversation_id=conv,
                                                   turn_id=str(uuid.uuid4()), content="")),
         grpc.StatusCode.INVALID_ARGUMENT, "content must not be empty"),
        (stub.BeginTurn(store_pb2.BeginTurnRequest(owner_id="alice", conversation_id=conv,
                                                   turn_id=str(uuid.uuid4()), content="x" * 1001)),
         grpc.StatusCode.INVALID_ARGUMENT, "limit of 1000 bytes"),
        (stub.BeginTurn(store_pb2.BeginTurnRequest(owner_id="mallory", conversation_id=conv,
                                                   turn_id=str(uuid.uuid4()), content="hi")),
         grpc.StatusCode.NOT_FOUND, "not found"),
        (stub.FinishTurn(store_pb2.FinishTurnRequest(owner_id="alice", conversation_id=conv,
                                                     turn_id=str(uuid.uuid4()), lease_id=str(uuid.uuid4()))),
         grpc.StatusCode.NOT_FOUND, "not found"),
        (stub.FailTurn(store_pb2.FailTurnRequest(owner_id="alice", conversation_id=conv, turn_id=str(uuid.uuid4()),
                                                 lease_id="")),
         grpc.StatusCode.INVALID_ARGUMENT, "lease_id"),
    ]
    for call, want, text in cases:
        code, details = await code_of(call)
        assert (code, text in details) == (want, True), details


async def finished_turn(stub: Stub, conv: str, content: str = "hi", regenerates: str = "") -> str:
    turn = str(uuid.uuid4())
    claimed = await stub.BeginTurn(store_pb2.BeginTurnRequest(
        owner_id="alice", conversation_id=conv, turn_id=turn, content=content, lease_holder="chat-1",
        regenerates_turn_id=regenerates))
    assert claimed.WhichOneof("outcome") == "claimed"
    await stub.FinishTurn(store_pb2.FinishTurnRequest(
        owner_id="alice", conversation_id=conv, turn_id=turn, lease_id=claimed.claimed.lease_id,
        reply=f"reply to {content or 'regenerate'}", usage=common_pb2.Usage(prompt_tokens=7, output_tokens=2)))
    return turn


async def test_attach_regenerate_summary(stub: Stub) -> None:
    conv = await new_conversation(stub)
    turn = str(uuid.uuid4())
    lease = (await stub.BeginTurn(store_pb2.BeginTurnRequest(
        owner_id="alice", conversation_id=conv, turn_id=turn, content="hi", lease_holder="chat-1"))).claimed.lease_id
    progress = await stub.UpdateTurnProgress(store_pb2.UpdateTurnProgressRequest(
        owner_id="alice", conversation_id=conv, turn_id=turn, lease_id=lease, partial_text="hel", event_sequence=3))
    assert progress.held and progress.lease_expires_at_ms > 0
    seen = await stub.ReadTurn(store_pb2.ReadTurnRequest(owner_id="alice", conversation_id=conv, turn_id=turn))
    assert (seen.state, seen.partial_text, seen.event_sequence) == (store_pb2.TURN_STATE_RUNNING, "hel", 3)
    assert not seen.HasField("reply")
    await stub.FinishTurn(store_pb2.FinishTurnRequest(owner_id="alice", conversation_id=conv, turn_id=turn,
                                                      lease_id=lease, reply="hello"))
    seen = await stub.ReadTurn(store_pb2.ReadTurnRequest(owner_id="alice", conversation_id=conv, turn_id=turn))
    assert seen.state == store_pb2.TURN_STATE_STORED and seen.reply.content == "hello"
    await finished_turn(stub, conv, content="", regenerates=turn)
    summary = await stub.SaveSummary(store_pb2.SaveSummaryRequest(
        owner_id="alice", conversation_id=conv, text="greetings", covers_through_index=0, token_count=2))
    assert summary.summary.covers_through_index == 0
    read = await stub.ReadConversation(store_pb2.ReadConversationRequest(owner_id="alice", conversation_id=conv))
    assert [(m.content, m.superseded) for m in read.messages] == [
        ("hi", False), ("hello", True), ("reply to regenerate", False)]
    assert read.summary.text == "greetings" and read.message_count == 3
    windowed = await stub.ReadConversation(store_pb2.ReadConversationRequest(
        owner_id="alice", conversation_id=conv, from_index=1, max_messages=1))
    assert [m.index for m in windowed.messages] == [2]


async def test_list_usage_export_delete_purge(stub: Stub) -> None:
    first, second = await new_conversation(stub), await new_conversation(stub)
    await finished_turn(stub, first)
    await finished_turn(stub, second)
    listed = await stub.ListOwnerConversations(store_pb2.ListOwnerConversationsRequest(owner_id="alice"))
    assert {c.conversation_id for c in listed.conversations} == {first, second}
    usage = await stub.ReadUsage(store_pb2.ReadUsageRequest(owner_id="alice"))
    assert [(d.turns, d.usage.prompt_tokens) for d in usage.days] == [(2, 14)]
    exported = json.loads((await stub.ExportOwnerData(store_pb2.ExportOwnerDataRequest(owner_id="alice"))).json)
    assert len(exported["conversations"]) == 2
    deleted = await stub.DeleteStoredConversation(store_pb2.DeleteStoredConversationRequest(
        owner_id="alice", conversation_id=first))
    assert list(deleted.evict_conversation_ids) == [first]
    code, _ = await code_of(stub.DeleteStoredConversation(store_pb2.DeleteStoredConversationRequest(
        owner_id="alice", conversation_id=first)))
    assert code == grpc.StatusCode.NOT_FOUND
    everything = await stub.DeleteOwnerData(store_pb2.DeleteOwnerDataRequest(owner_id="alice"))
    assert list(everything.evict_conversation_ids) == [second]
    # the retention purge is the operator's (tests/mesh/test_authz_rpcs.py calls it as the operator), not chat's
    code, details = await code_of(stub.PurgeExpired(store_pb2.PurgeExpiredRequest()))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "spiffe://chatmesh/chat may not call" in details


async def test_begin_turn_returns_context(stub: Stub) -> None:
    conv = await new_conversation(stub)
    begin = store_pb2.BeginTurnRequest(owner_id="alice", conversation_id=conv, turn_id=str(uuid.uuid4()),
                                       content="first", lease_holder="chat-1")
    plain = await stub.BeginTurn(begin)
    assert plain.WhichOneof("outcome") == "claimed" and not plain.claimed.HasField("context")
    await stub.FinishTurn(store_pb2.FinishTurnRequest(
        owner_id="alice", conversation_id=conv, turn_id=begin.turn_id, lease_id=plain.claimed.lease_id,
        user_token_count=1, reply="reply one", reply_token_count=2))
    await stub.SaveSummary(store_pb2.SaveSummaryRequest(owner_id="alice", conversation_id=conv, text="s",
                                                        covers_through_index=0, token_count=1))
    second = await stub.BeginTurn(store_pb2.BeginTurnRequest(
        owner_id="alice", conversation_id=conv, turn_id=str(uuid.uuid4()), content="second", lease_holder="chat-1",
        context_max_messages=20))
    assert second.WhichOneof("outcome") == "claimed" and second.claimed.HasField("context")
    context = second.claimed.context
    assert context.conversation.conversation_id == conv and context.message_count == 2
    assert context.summary.text == "s" and context.summary.covers_through_index == 0
    assert [(m.index, m.role, m.content) for m in context.messages] == [(1, common_pb2.ROLE_ASSISTANT, "reply one")]
    code, details = await code_of(stub.BeginTurn(store_pb2.BeginTurnRequest(
        owner_id="alice", conversation_id=conv, turn_id=str(uuid.uuid4()), content="x", lease_holder="c",
        context_max_messages=-1)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "context_max_messages" in details


async def test_calls_cancelled_mid_statement_leave_no_unretrieved_exception(backend: Backend, tmp_path: Path,
                                                                          mesh_certs: Path) -> None:
    """A caller that goes away mid-call (chat stopping a turn's heartbeat, a deadline) cancels the handler; the
    statement it was running must not leave the database driver's future unretrieved (PostgreSQL: asyncpg's
    "unexpected connection_lost()" once SQLAlchemy drops the interrupted connection), a line in the store's log,
    up to and including the store's stop (which waits for every handler to end)."""
    loop = asyncio.get_running_loop()
    seen: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: seen.append(str(ctx.get("message"))))
    try:
        async with serving(backend, tmp_path, mesh_certs) as stub:
            await cancel_calls_mid_statement(stub)
        gc.collect()
        await asyncio.sleep(0)  # a callback the collection scheduled runs
    finally:
        loop.set_exception_handler(previous)
    assert seen == []


async def cancel_calls_mid_statement(stub: Stub) -> None:
    """80 calls cancelled at varying points of their statement, then one that must still be served."""
    conv = await new_conversation(stub)
    turn = str(uuid.uuid4())
    claimed = await stub.BeginTurn(store_pb2.BeginTurnRequest(
        owner_id="alice", conversation_id=conv, turn_id=turn, fingerprint="f", content="hi",
        lease_holder="chat-1", lease_ttl_ms=10_000))
    for i in range(80):
        call = stub.UpdateTurnProgress(store_pb2.UpdateTurnProgressRequest(
            owner_id="alice", conversation_id=conv, turn_id=turn, lease_id=claimed.claimed.lease_id,
            partial_text="x" * i, event_sequence=i, lease_ttl_ms=10_000))
        await asyncio.sleep((i % 8) * 0.0005)
        call.cancel()
    progress = await stub.UpdateTurnProgress(store_pb2.UpdateTurnProgressRequest(
        owner_id="alice", conversation_id=conv, turn_id=turn, lease_id=claimed.claimed.lease_id,
        partial_text="done", event_sequence=100, lease_ttl_ms=10_000))
    assert progress.held  # the store still serves the turn after the cancelled calls
