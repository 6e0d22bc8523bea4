"""Conversation reads and deletion: what a user's conversation list, export and usage pages ask of the store, and
deletion reaching every copy (I4): the stored rows, then the conversation's KV blocks on every engine replica."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from chatmesh.chat.admission import screen_seed
from chatmesh.chat.ports import EnginePort, ModerationPort, RouterPort, StorePort, TurnKey
from chatmesh.mesh import errors, logs
from chatmesh.mesh.ids import ConversationId, OwnerId
from chatmesh.store.values import Conversation, DailyUsage, History, Seed

log = logs.get("chatmesh.chat")

MAX_TITLE_CHARS = 200


class Conversations:
    def __init__(self, store: StorePort, router: RouterPort, engines: EnginePort, moderation: ModerationPort,
                 default_prompt_version: str, stop_turns: Callable[[OwnerId, ConversationId], None],
                 count_tokens: Callable[[str], int]):
        self.moderation = moderation
        self.count_tokens = count_tokens
        self.store = store
        self.router = router
        self.engines = engines
        self.default_prompt_version = default_prompt_version
        self.stop_turns = stop_turns  # stops this process's turns of a conversation being deleted

    async def create(self, owner: OwnerId, title: str, seed: tuple[Seed, ...] = ()) -> Conversation:
        """A new conversation; with `seed`, holding those messages (a client's earlier history) already. The
        seed's user messages pass the input check first (`admission.screen_seed`): one blocked refuses the creation
        (InvalidArgument naming it), nothing stored."""
        if len(title) > MAX_TITLE_CHARS:
            raise errors.InvalidArgument(f"title must be at most {MAX_TITLE_CHARS} characters")
        if not seed:
            return await self.store.insert_conversation(owner, title, self.default_prompt_version)
        conversation = ConversationId(str(uuid.uuid4()))
        await screen_seed(self.moderation, conversation, seed)
        counted = tuple(Seed(m.role, m.content, self.count_tokens(m.content)) for m in seed)
        conv, _ = await self.store.create_conversation(owner, conversation, title, self.default_prompt_version,
                                                       counted)
        return conv

    async def get(self, owner: OwnerId, conv: ConversationId) -> History:
        return await self.store.read_conversation(owner, conv)

    async def list_owned(self, owner: OwnerId, page_size: int) -> list[Conversation]:
        if page_size < 0 or page_size > 500:
            raise errors.InvalidArgument("page_size must be between 0 and 500")
        return await self.store.list_conversations(owner, page_size or 50)

    async def delete(self, owner: OwnerId, conv: ConversationId) -> int:
        """Deletes every stored row, then evicts the conversation's KV blocks on every engine (I4)."""
        self.stop_turns(owner, conv)
        return await self._evict(owner, conv, await self.store.delete_conversation(owner, conv))

    async def delete_turn(self, key: TurnKey) -> int:
        """Deletes one stored turn (its messages and regenerations), then the conversation's KV blocks on every
        engine: they hold the deleted text (I4); the next turn prefills the rest again."""
        return await self._evict(key.owner, key.conversation, await self.store.delete_turn(key))

    async def _evict(self, owner: OwnerId, conv: ConversationId, evict: list[ConversationId]) -> int:
        evicted = 0
        for replica in await self.router.replicas():
            for conversation_id in evict:
                try:
                    evicted += await self.engines.evict(replica.address, owner, conversation_id)
                except errors.Unavailable:
                    # A replica that is down holds nothing it could serve; its cache dies with it.
                    log.warning("evict_unreachable", replica_id=replica.replica_id, conversation_id=conv)
        return evicted

    async def usage(self, owner: OwnerId, days: int) -> list[DailyUsage]:
        if days < 0 or days > 366:
            raise errors.InvalidArgument("days must be between 0 and 366")
        return await self.store.usage(owner, days or 30)

    async def export(self, owner: OwnerId) -> str:
        return await self.store.export(owner)
