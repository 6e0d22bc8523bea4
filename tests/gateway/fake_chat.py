"""A small in-test ChatService (a test double of our own contract, for unit tests of the edge only) over real
gRPC. It keeps conversations per owner in memory and streams each reply as the configured `chunks`, waiting
`delay_s` before each delta; it records what the edge asked for (owners, cancellations, prompt-token
allowances) so tests can check. As the contract says, a turn whose prompt (`prompt_tokens`) is over its
allowance is refused RESOURCE_EXHAUSTED with the `chatmesh-prompt-tokens` trailer before it starts, turn.started
reports the prompt's size, and a replay says `replayed`; `billed` adds up the prompt tokens of the turns that
generated (what the store bills). It honours the OpenAI surface's parts of the contract too: turn options (recorded), `create` (a conversation
seeded with messages), `expect_last_turn_id`, GetTurn and DeleteTurn; `generations` counts the replies generated."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pathlib import Path

import grpc

from chatmesh.chat import service as chat_service
from chatmesh.mesh import identity
from chatmesh.mesh.server import Service, start_server
from chatmesh.mesh.tokens import OwnerClaims
from chatmesh.v1 import chat_pb2, chat_pb2_grpc, common_pb2
from tests.trust import OwnerChecked, trust_as

Ctx = grpc.aio.ServicerContext[object, object]


@dataclass
class Turn:
    turn_id: str
    content: str
    events: list[chat_pb2.TurnEvent] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    grew: asyncio.Condition = field(default_factory=asyncio.Condition)
    stop: bool = False
    status: chat_pb2.TurnStatus = chat_pb2.TURN_STATUS_RUNNING
    reply: str = ""
    usage: common_pb2.Usage = field(default_factory=common_pb2.Usage)
    stored_at_ms: int = 0


@dataclass
class Conv:
    meta: common_pb2.Conversation
    messages: list[common_pb2.Message] = field(default_factory=list)
    turns: dict[str, Turn] = field(default_factory=dict)


class FakeChat(chat_pb2_grpc.ChatServiceServicer):
    def __init__(self) -> None:
        self.convs: dict[str, Conv] = {}
        self.chunks: list[str] = ["Hello", ", ", "world", "."]
        self.delay_s = 0.0
        self.cancelled: list[str] = []
        self.released: list[tuple[str, bool]] = []  # StopTurn with release: (turn id, whether it still ran)
        self.owners_seen: list[str] = []
        self.prompt_tokens = 7
        self.options: list[chat_pb2.TurnOptions] = []
        self.generations = 0
        self.finish_reason = "stop"
        self.allowances: list[int] = []
        self.billed = 0
        self.report_prompt_tokens = True
        self.token_claims: list[OwnerClaims] = []  # with mutual TLS: the verified owner token of each call
        self.summaries: dict[str, tuple[str, int]] = {}  # conversation -> (summary, last index it covers)
        # how each reply ends after its chunks: None (completed, or stopped when asked to stop), a TurnFailed
        # (nothing stored, as chat fails a turn) or a TurnBlocked (moderation blocked the output)
        self.ending: chat_pb2.TurnFailed | chat_pb2.TurnBlocked | None = None

    async def _admit(self, allowance: int, context: Ctx) -> None:
        self.allowances.append(allowance)
        if allowance and self.prompt_tokens > allowance:
            context.set_trailing_metadata((("chatmesh-prompt-tokens", str(self.prompt_tokens)),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the prompt is {self.prompt_tokens} tokens; the allowance is {allowance}")

    def _conv(self, owner: str, conv_id: str) -> Conv | None:
        self.owners_seen.append(owner)
        conv = self.convs.get(conv_id)
        return conv if conv is not None and conv.meta.owner_id == owner else None

    def _create(self, owner: str, conv_id: str, title: str, seed: list[common_pb2.SeedMessage]) -> Conv:
        now = int(time.time() * 1000)
        meta = common_pb2.Conversation(conversation_id=conv_id, owner_id=owner, title=title, created_at_ms=now,
                                       updated_at_ms=now)
        conv = self.convs[conv_id] = Conv(meta)
        for m in seed:
            conv.messages.append(common_pb2.Message(index=len(conv.messages), role=m.role, content=m.content,
                                                    turn_id=str(uuid.uuid4()),
                                                    status=common_pb2.MESSAGE_STATUS_COMPLETE))
        return conv

    async def CreateConversation(self, request: chat_pb2.CreateConversationRequest,
                                 context: Ctx) -> chat_pb2.CreateConversationResponse:
        conv = self._create(request.owner_id, str(uuid.uuid4()), request.title, list(request.messages))
        return chat_pb2.CreateConversationResponse(conversation=conv.meta)

    async def GetConversation(self, request: chat_pb2.GetConversationRequest,
                              context: Ctx) -> chat_pb2.GetConversationResponse:
        conv = self._conv(request.owner_id, request.conversation_id)
        if conv is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "conversation not found")
        assert conv is not None
        return chat_pb2.GetConversationResponse(conversation=conv.meta, messages=conv.messages)

    async def ListConversations(self, request: chat_pb2.ListConversationsRequest,
                                context: Ctx) -> chat_pb2.ListConversationsResponse:
        mine = [c.meta for c in self.convs.values() if c.meta.owner_id == request.owner_id]
        return chat_pb2.ListConversationsResponse(conversations=mine[: request.page_size or 50])

    async def DeleteConversation(self, request: chat_pb2.DeleteConversationRequest,
                                 context: Ctx) -> chat_pb2.DeleteConversationResponse:
        if self._conv(request.owner_id, request.conversation_id) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "conversation not found")
        del self.convs[request.conversation_id]
        return chat_pb2.DeleteConversationResponse(blocks_evicted=3)

    async def GetUsage(self, request: chat_pb2.GetUsageRequest, context: Ctx) -> chat_pb2.GetUsageResponse:
        return chat_pb2.GetUsageResponse(days=[chat_pb2.DailyUsage(
            day="2026-11-29", turns=1, usage=common_pb2.Usage(prompt_tokens=self.prompt_tokens))])

    async def ExportUserData(self, request: chat_pb2.ExportUserDataRequest,
                             context: Ctx) -> chat_pb2.ExportUserDataResponse:
        mine = [{"id": c.meta.conversation_id, "messages": [m.content for m in c.messages]}
                for c in self.convs.values() if c.meta.owner_id == request.owner_id]
        return chat_pb2.ExportUserDataResponse(json=json.dumps({"conversations": mine}))

    async def StopTurn(self, request: chat_pb2.StopTurnRequest, context: Ctx) -> chat_pb2.StopTurnResponse:
        conv = self._conv(request.owner_id, request.conversation_id)
        turn = conv.turns.get(request.turn_id) if conv else None
        if turn is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "turn not found")
        assert turn is not None
        running = not turn.done.is_set()
        if request.release:
            self.released.append((request.turn_id, running))
            return chat_pb2.StopTurnResponse(stopped=running)
        turn.stop = True
        return chat_pb2.StopTurnResponse(stopped=running)

    async def SendTurn(self, request: chat_pb2.SendTurnRequest,
                       context: Ctx) -> AsyncIterator[chat_pb2.SendTurnResponse]:
        if request.HasField("create") and request.conversation_id not in self.convs:
            self._create(request.owner_id, request.conversation_id, request.create.title,
                         list(request.create.messages))
        conv = self._conv(request.owner_id, request.conversation_id)
        if conv is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "conversation not found")
        assert conv is not None
        known = conv.turns.get(request.turn_id)
        if known is not None:
            if known.content != request.content:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, "turn_id was used with other content")
            async for ev in self._follow(known, 0):
                yield chat_pb2.SendTurnResponse(event=ev)
            return
        live = [m for m in conv.messages if not m.superseded]
        if request.expect_last_turn_id and (not live or live[-1].turn_id != request.expect_last_turn_id):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the conversation has moved on")
        await self._admit(request.prompt_token_allowance, context)
        self.options.append(request.options)
        turn = Turn(request.turn_id, request.content)
        conv.turns[turn.turn_id] = turn
        conv.messages.append(common_pb2.Message(index=len(conv.messages), role=common_pb2.ROLE_USER,
                                                content=request.content, turn_id=turn.turn_id,
                                                status=common_pb2.MESSAGE_STATUS_COMPLETE))
        async for ev in self._generate(conv, turn, context):
            yield chat_pb2.SendTurnResponse(event=ev)

    async def RegenerateTurn(self, request: chat_pb2.RegenerateTurnRequest,
                             context: Ctx) -> AsyncIterator[chat_pb2.RegenerateTurnResponse]:
        conv = self._conv(request.owner_id, request.conversation_id)
        if conv is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "conversation not found")
        assert conv is not None
        known = conv.turns.get(request.turn_id)
        if known is not None:
            async for ev in self._follow(known, 0):
                yield chat_pb2.RegenerateTurnResponse(event=ev)
            return
        await self._admit(request.prompt_token_allowance, context)
        self.options.append(request.options)
        for m in conv.messages:
            if m.role == common_pb2.ROLE_ASSISTANT and m.index == len(conv.messages) - 1:
                m.superseded = True
        turn = Turn(request.turn_id, "")
        conv.turns[turn.turn_id] = turn
        async for ev in self._generate(conv, turn, context):
            yield chat_pb2.RegenerateTurnResponse(event=ev)

    async def AttachTurn(self, request: chat_pb2.AttachTurnRequest,
                         context: Ctx) -> AsyncIterator[chat_pb2.AttachTurnResponse]:
        conv = self._conv(request.owner_id, request.conversation_id)
        turn = conv.turns.get(request.turn_id) if conv else None
        if turn is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "turn not found")
        assert turn is not None
        async for ev in self._follow(turn, request.after_sequence):
            yield chat_pb2.AttachTurnResponse(event=ev)

    async def GetTurn(self, request: chat_pb2.GetTurnRequest, context: Ctx) -> chat_pb2.GetTurnResponse:
        conv = self._conv(request.owner_id, request.conversation_id)
        turn = conv.turns.get(request.turn_id) if conv else None
        if turn is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "turn not found")
        assert turn is not None
        return chat_pb2.GetTurnResponse(status=turn.status, reply=turn.reply, usage=turn.usage,
                                        stored_at_ms=turn.stored_at_ms,
                                        finish_reason=self.finish_reason if turn.status == chat_pb2.TURN_STATUS_COMPLETED else "")

    async def CompactConversation(self, request: chat_pb2.CompactConversationRequest, context: Ctx
                                  ) -> chat_pb2.CompactConversationResponse:
        conv = self._conv(request.owner_id, request.conversation_id)
        if conv is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "conversation not found")
        assert conv is not None
        live = [m for m in conv.messages if not m.superseded]
        if not live or live[-1].role != common_pb2.ROLE_ASSISTANT or (
                request.expect_last_turn_id and live[-1].turn_id != request.expect_last_turn_id):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "nothing to compact at that point")
        text = "Summary: " + " | ".join(m.content for m in live)
        fresh = self.summaries.get(conv.meta.conversation_id, ("", -1))[1] < conv.messages[-1].index
        self.summaries[conv.meta.conversation_id] = (text, conv.messages[-1].index)
        return chat_pb2.CompactConversationResponse(summary_text=text, covers_through_index=conv.messages[-1].index,
                                                    token_count=len(text.split()), prompt_tokens=11 if fresh else 0)

    async def DeleteTurn(self, request: chat_pb2.DeleteTurnRequest, context: Ctx) -> chat_pb2.DeleteTurnResponse:
        conv = self._conv(request.owner_id, request.conversation_id)
        turn = conv.turns.get(request.turn_id) if conv else None
        if conv is None or turn is None or not turn.done.is_set():
            await context.abort(grpc.StatusCode.NOT_FOUND, "turn not found")
        assert conv is not None
        del conv.turns[request.turn_id]
        conv.messages = [m for m in conv.messages if m.turn_id != request.turn_id]
        return chat_pb2.DeleteTurnResponse(blocks_evicted=1)

    async def _follow(self, turn: Turn, after: int) -> AsyncIterator[chat_pb2.TurnEvent]:
        sent = after
        while True:
            async with turn.grew:
                await turn.grew.wait_for(lambda: len(turn.events) > sent or turn.done.is_set())
            new = turn.events[sent:]
            sent += len(new)  # events appended while these are yielded come next round
            for ev in new:
                if ev.WhichOneof("kind") == "started":
                    ev = chat_pb2.TurnEvent(sequence=ev.sequence, started=chat_pb2.TurnStarted(
                        turn_id=ev.started.turn_id, replayed=True))
                yield ev
            if turn.done.is_set() and sent == len(turn.events):
                return

    async def _emit(self, turn: Turn, ev: chat_pb2.TurnEvent) -> chat_pb2.TurnEvent:
        ev.sequence = len(turn.events) + 1
        async with turn.grew:
            turn.events.append(ev)
            turn.grew.notify_all()
        return ev

    async def _generate(self, conv: Conv, turn: Turn, context: Ctx) -> AsyncIterator[chat_pb2.TurnEvent]:
        text = ""
        self.generations += 1
        try:
            started = chat_pb2.TurnStarted(turn_id=turn.turn_id)
            if self.report_prompt_tokens:
                started.prompt_tokens = self.prompt_tokens
            self.billed += self.prompt_tokens
            yield await self._emit(turn, chat_pb2.TurnEvent(started=started))
            for chunk in self.chunks:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if turn.stop:
                    break
                text += chunk
                turn.reply = text
                yield await self._emit(turn, chat_pb2.TurnEvent(delta=chat_pb2.TurnDelta(text=chunk)))
            if isinstance(self.ending, chat_pb2.TurnFailed) and not turn.stop:
                conv.messages = [m for m in conv.messages if m.turn_id != turn.turn_id]
                turn.reply, turn.status = "", chat_pb2.TURN_STATUS_FAILED
                yield await self._emit(turn, chat_pb2.TurnEvent(failed=self.ending))
                return
            if isinstance(self.ending, chat_pb2.TurnBlocked) and not turn.stop:
                turn.reply, turn.status, turn.stored_at_ms = "", chat_pb2.TURN_STATUS_BLOCKED, int(time.time() * 1000)
                yield await self._emit(turn, chat_pb2.TurnEvent(blocked=self.ending))
                return
            usage = common_pb2.Usage(prompt_tokens=self.prompt_tokens, cached_prompt_tokens=2,
                                     output_tokens=len(self.chunks))
            status = common_pb2.MESSAGE_STATUS_STOPPED if turn.stop else common_pb2.MESSAGE_STATUS_COMPLETE
            conv.messages.append(common_pb2.Message(index=len(conv.messages), role=common_pb2.ROLE_ASSISTANT,
                                                    content=text, turn_id=turn.turn_id, status=status))
            turn.reply, turn.usage, turn.stored_at_ms = text, usage, int(time.time() * 1000)
            turn.status = chat_pb2.TURN_STATUS_STOPPED if turn.stop else chat_pb2.TURN_STATUS_COMPLETED
            final = chat_pb2.TurnEvent(stopped=chat_pb2.TurnStopped(usage=usage)) if turn.stop else \
                chat_pb2.TurnEvent(completed=chat_pb2.TurnCompleted(usage=usage, replica_id="fake-0",
                                                                    finish_reason=self.finish_reason))
            yield await self._emit(turn, final)
        except asyncio.CancelledError:
            self.cancelled.append(turn.turn_id)
            raise
        finally:
            turn.done.set()
            async with turn.grew:
                turn.grew.notify_all()


async def start_fake_chat(port: int, certs: Path | None = None, fake: FakeChat | None = None
                          ) -> tuple[grpc.aio.Server, FakeChat]:
    """In plaintext; with `certs`, as chat does in the mesh: mutual TLS as spiffe://chatmesh/chat, ChatService's
    authorization table, and every call's owner token checked (the verified claims in `fake.token_claims`)."""
    fake = fake or FakeChat()
    if certs is None:
        server = grpc.aio.server()
        chat_pb2_grpc.add_ChatServiceServicer_to_server(fake, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server, fake
    trust = trust_as(certs, identity.CHAT)
    assert trust.verifier is not None
    checked = OwnerChecked(fake, trust.verifier)
    fake.token_claims = checked.claims

    def register(server: grpc.aio.Server) -> list[str]:
        chat_pb2_grpc.add_ChatServiceServicer_to_server(checked, server)  # type: ignore[arg-type]
        return ["chatmesh.v1.ChatService"]

    running = await start_server(Service(name="chat", register=register, authz=chat_service.AUTHZ),
                                 f"127.0.0.1:{port}", trust=trust)
    return running.server, fake
