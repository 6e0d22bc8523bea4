"""What every OpenAI route needs, built once per process in the app's lifespan, and who is calling.

Front-ends. A key marked as a trusted front-end (`chatmesh keys create NAME --frontend`) serves many people
through one connection and names the end user of each request: Open WebUI's `X-OpenWebUI-User-Id` (forwarded with
ENABLE_FORWARD_USER_INFO_HEADERS) or `X-Chatmesh-End-User` (LibreChat: `{{LIBRECHAT_USER_ID}}`). Each named end user
is an owner of their own, `uuid5(front-end's user, end user)`: own conversations, own limits, own cache salt
(chat derives the salt from the owner id). Any other caller that names a user (any of Open WebUI's user headers)
is refused with 403: a user id in a header is only believed from a key the operator marked.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from starlette.requests import Request

from chatmesh.gateway.accounts import Accounts
from chatmesh.gateway.errors import ApiError
from chatmesh.gateway.identity import Via
from chatmesh.gateway.openai.errors import OpenAIError, invalid
from chatmesh.gateway.openai.history import HistoryIndex
from chatmesh.gateway.openai.records import TurnRecords
from chatmesh.gateway.openai.response_object import Sampling
from chatmesh.gateway.openai.turns import Continuity
from chatmesh.gateway.openai.wire import Message
from chatmesh.gateway.routes import Edge
from chatmesh.mesh import ids

END_USER_HEADERS = ("x-openwebui-user-id", "x-chatmesh-end-user")
NAMING_HEADERS = END_USER_HEADERS + ("x-openwebui-user-name", "x-openwebui-user-email", "x-openwebui-user-role")
CHAT_HEADERS = ("x-openwebui-chat-id", "x-chatmesh-chat-id")
TURN_KEY_HEADERS = ("idempotency-key", "x-openwebui-message-id")
TASK_HEADER = "x-openwebui-task"
MAX_HEADER_CHARS = 256
_END_USERS = uuid.UUID("0c8f3c1a-54a4-4f4c-9d43-5ab0e8ad7f21")


@dataclass
class Surface:
    edge: Edge
    accounts: Accounts
    index: HistoryIndex
    model: str
    context_tokens: int
    reply_cap: int
    sampling: Sampling = field(default_factory=Sampling)  # chat's defaults, reported when a request sets none
    created_at: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.records = TurnRecords(self.index.engine)
        self.turns = Continuity(self.edge, self.index, self.records)

    async def forget(self, owner: ids.OwnerId, conversation: ids.ConversationId) -> None:
        """What the surface keeps of a deleted conversation: its history digests and its turns' records."""
        await self.index.forget(owner, conversation)
        await self.records.forget(owner, conversation)

    async def check_sizes(self, messages: Sequence[Message], param: str) -> None:
        """Each message against the edge's message size policy (chatmesh.gateway.token_counts), named when over it."""
        for i, m in enumerate(messages):
            where = f"{param}[{i}].content"
            try:
                await self.edge.message_tokens.check(m.text, where)
            except ApiError as err:
                raise OpenAIError(400, err.code, err.message, where) from None

    def check_model(self, model: str) -> None:
        if model != self.model:
            raise OpenAIError(404, "model_not_found", f"model {model[:64]!r} not found; this server serves "
                                                      f"{self.model!r} (GET /models)", "model")


def surface_of(request: Request) -> Surface:
    surface: Surface = request.app.state.openai
    return surface


def header(request: Request, names: tuple[str, ...]) -> str | None:
    for name in names:
        value = request.headers.get(name)
        if value:
            if len(value) > MAX_HEADER_CHARS or not value.isprintable():
                raise invalid(None, f"header {name}: 1-{MAX_HEADER_CHARS} printable characters")
            return value
    return None


def end_user_owner(frontend: ids.OwnerId, end_user: str) -> ids.OwnerId:
    return ids.OwnerId(str(uuid.uuid5(_END_USERS, f"{frontend}\0{end_user}")))


async def owner_of(request: Request, surface: Surface) -> ids.OwnerId:
    """The owner every ChatService call of this request carries: the key's user, or the named end user of a
    trusted front-end."""
    who = await surface.edge.auth.identify(request)
    if not any(name in request.headers for name in NAMING_HEADERS):
        return who.owner
    token = request.headers.get("authorization", "").partition(" ")[2].strip()
    if who.via is not Via.API_KEY or not await surface.accounts.is_frontend_key(surface.accounts.digest(token)):
        raise OpenAIError(403, "permission_denied",
                          "this key may not name an end user (X-OpenWebUI-User-*): only a key created with "
                          "`chatmesh keys create NAME --frontend` may; drop the header or use such a key")
    end_user = header(request, END_USER_HEADERS)
    if end_user is None:
        raise invalid(None, "a front-end naming its user must send X-OpenWebUI-User-Id (or X-Chatmesh-End-User)")
    return end_user_owner(who.owner, end_user)


def retry_count(request: Request) -> int:
    raw = request.headers.get("x-stainless-retry-count", "0")
    return int(raw) if raw.isdigit() else 0
