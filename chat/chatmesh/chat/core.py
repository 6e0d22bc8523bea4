"""The chat core: one turn's journey through store, moderation, router and engine, in small modules.

    core.py           this facade: the ChatService's operations, wired to the modules below
    conversations.py  conversation reads, listing, usage, export; deletion reaching every copy (I4)
    turns.py          the lifecycle's entry points (send, regenerate, attach, stop) and the claim (I2)
    claimed.py        a claimed turn generated to its end: heartbeat, finish or fail, once (I5)
    follow.py         following a turn another chat process generates, and taking it over when it dies
    admission.py      the replica pick and the input check, begun with the claim
    prompt.py         the prompt: what is replayed, summaries at turn boundaries (I3), generations by owner (I1)
    context.py        the context builder's fixed order (pure)
    stream.py         engine events relayed to the user, each chunk screened first
    events.py         the turn's stream events and the live-turn broadcast
    ports.py          what the core needs of the other services, in domain values
    chatmesh.mesh.turn  the one turn state machine every path drives, and what the store records of it

No module of the core imports grpc or protobuf: `clients.py` and `service.py` are the edges (a test checks).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from chatmesh.chat import context
from chatmesh.chat.conversations import Conversations
from chatmesh.chat.events import TurnEvent
from chatmesh.chat.options import DEFAULT_TURN, ChatOptions, TurnOptions
from chatmesh.chat.ports import EnginePort, ModerationPort, PeerPort, Ports, RouterPort, StorePort, TurnKey
from chatmesh.chat.prompt import DEFAULT_SYSTEM_PROMPTS, Compacted, Prompts
from chatmesh.chat.turns import NewConversation, Turns
from chatmesh.mesh.ids import ConversationId, OwnerId, TurnId
from chatmesh.mesh.turn import Move
from chatmesh.store.values import Conversation, DailyUsage, History, Seed, ToolResult, TurnRecord

__all__ = ["ChatCore", "ChatOptions", "DEFAULT_SYSTEM_PROMPTS"]


def wall_clock_ms() -> float:
    return time.time() * 1000


class ChatCore:
    def __init__(self, store: StorePort, router: RouterPort, engines: EnginePort, moderation: ModerationPort,
                 renderer: context.Renderer, count_tokens: Callable[[str], int], options: ChatOptions,
                 peers: PeerPort | None = None, *, observe: Callable[[Move], None] | None = None,
                 now_ms: Callable[[], float] = wall_clock_ms):
        self.renderer = renderer
        ports = Ports(store, router, engines, moderation, peers)
        self.prompts = Prompts(ports, renderer, count_tokens, options)
        self.turns = Turns(ports, self.prompts, options, observe, now_ms)
        self.conversations = Conversations(store, router, engines, moderation, options.default_prompt_version,
                                           self._stop_all, count_tokens)

    # ---- conversations -------------------------------------------------------------------------------------

    async def create_conversation(self, owner: OwnerId, title: str, seed: tuple[Seed, ...] = ()) -> Conversation:
        return await self.conversations.create(owner, title, seed)

    async def get_conversation(self, owner: OwnerId, conv: ConversationId) -> History:
        return await self.conversations.get(owner, conv)

    async def list_conversations(self, owner: OwnerId, page_size: int) -> list[Conversation]:
        return await self.conversations.list_owned(owner, page_size)

    async def delete_conversation(self, owner: OwnerId, conv: ConversationId) -> int:
        return await self.conversations.delete(owner, conv)

    async def usage(self, owner: OwnerId, days: int) -> list[DailyUsage]:
        return await self.conversations.usage(owner, days)

    async def export(self, owner: OwnerId) -> str:
        return await self.conversations.export(owner)

    # ---- turns ---------------------------------------------------------------------------------------------

    def send_turn(self, owner: OwnerId, conv: ConversationId, turn: TurnId, content: str,
                  options: TurnOptions = DEFAULT_TURN, create: NewConversation | None = None,
                  expect_last: TurnId | None = None, results: tuple[ToolResult, ...] = (), allowance: int = 0
                  ) -> AsyncIterator[TurnEvent]:
        return self.turns.send(TurnKey(owner, conv, turn), content, options, create, expect_last, results, allowance)

    def regenerate(self, owner: OwnerId, conv: ConversationId, turn: TurnId, options: TurnOptions = DEFAULT_TURN,
                   allowance: int = 0) -> AsyncIterator[TurnEvent]:
        return self.turns.regenerate(TurnKey(owner, conv, turn), options, allowance)

    async def get_turn(self, owner: OwnerId, conv: ConversationId, turn: TurnId) -> TurnRecord:
        return await self.turns.get(TurnKey(owner, conv, turn))

    async def delete_turn(self, owner: OwnerId, conv: ConversationId, turn: TurnId) -> int:
        return await self.conversations.delete_turn(TurnKey(owner, conv, turn))

    def attach(self, owner: OwnerId, conv: ConversationId, turn: TurnId, after: int) -> AsyncIterator[TurnEvent]:
        return self.turns.attach(TurnKey(owner, conv, turn), after)

    async def stop(self, owner: OwnerId, conv: ConversationId, turn: TurnId) -> bool:
        return await self.turns.stop(TurnKey(owner, conv, turn))

    async def release(self, owner: OwnerId, conv: ConversationId, turn: TurnId) -> bool:
        """The turn's client went away having been shown nothing: released for its retry, not stored stopped."""
        return await self.turns.release(TurnKey(owner, conv, turn))

    async def compact(self, owner: OwnerId, conv: ConversationId, expect_last: TurnId | None) -> Compacted:
        """The conversation summarised through its last reply, stored as its summary (`Prompts.compact`)."""
        return await self.prompts.compact(owner, conv, expect_last)

    async def next_prompt(self, owner: OwnerId, conv: ConversationId, new_message: str) -> context.Rendered:
        """The prompt the next turn with `new_message` would send (no summarising side effect)."""
        return await self.prompts.next_prompt(owner, conv, new_message)

    def mark_draining(self) -> None:
        self.turns.mark_draining()

    async def close(self) -> None:
        await self.turns.close()

    def _stop_all(self, owner: OwnerId, conv: ConversationId) -> None:
        for key, live in list(self.turns.live.items()):
            if (key.owner, key.conversation) == (owner, conv):
                live.stop_requested.set()
