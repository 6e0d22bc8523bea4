"""Token counts at the edge: a message's size against the message size policy (chatmesh.mesh.message_size) before
anything reaches chat, and the largest prompt the model takes (what a turn reserves).

A message is counted only when it could be over its token limit: every token of a byte-level BPE covers at
least one byte, so a message of at most `limit` UTF-8 bytes has at most `limit` tokens and passes uncounted
(with a 7,936-token limit: every message under ~8 KB; with 128,000: under 128 KB). Longer ones are counted on
a worker thread, one at a time per process, so the event loop keeps serving streams while a paste is counted
(~0.3 s per MB of ordinary text here).

`count_message_tokens` is the one place the edge asks how many tokens a text is; it counts with the served model's
profile (chatmesh.model.profile, CHATMESH_MODEL: the tokenizer chat renders with and the engines serve), loaded
once on first need. Without the model's files the edge skips the count and leaves the check to chat.
"""

from __future__ import annotations

import asyncio
import threading

from chatmesh.chat import settings as chat_settings
from chatmesh.gateway.errors import ApiError
from chatmesh.mesh import logs
from chatmesh.mesh.config import Config
from chatmesh.mesh.message_size import MessageSize, MessageTooLong
from chatmesh.model import assets, profile
from chatmesh.model import settings as model_settings

log = logs.get("chatmesh.gateway.token_counts")


def model_input_tokens(cfg: Config, context_tokens: int | None = None) -> int:
    """The most prompt tokens the configured model takes: its context (`context_tokens`: the served model's
    within CHATMESH_CONTEXT_TOKENS, as chat uses; default the setting) minus the reply's tokens, within the
    configured prompt cap. Every turn's prompt fits in it (chat refuses the rest), so it bounds a reservation."""
    context = cfg[chat_settings.CONTEXT_TOKENS] if context_tokens is None else context_tokens
    room = context - cfg[chat_settings.MAX_REPLY_TOKENS]
    return max(1, min(cfg[chat_settings.PROMPT_CAP_TOKENS], room))


def count_message_tokens(served: profile.ModelProfile, text: str) -> int:
    return served.count(text)


def too_long(err: MessageTooLong) -> ApiError:
    return ApiError(400, "message_too_long", str(err))


class MessageTokens:
    """Checks a message against the size policy for the configured model (see the module header)."""

    def __init__(self, policy: MessageSize, input_tokens: int, model: str, model_dir: str) -> None:
        """`model`, `model_dir`: CHATMESH_MODEL and CHATMESH_MODEL_DIR (the profile is loaded on first count)."""
        self.policy = policy
        self.input_tokens = input_tokens
        self.limit = policy.token_limit(input_tokens)
        self._model = model
        self._model_dir = model_dir
        self._profile: profile.ModelProfile | None = None
        self._missing = False
        self._load_lock = threading.Lock()
        self._one_at_a_time = asyncio.Semaphore(1)

    @classmethod
    def from_config(cls, cfg: Config, context_tokens: int | None = None) -> MessageTokens:
        return cls(MessageSize.from_config(cfg), model_input_tokens(cfg, context_tokens), cfg[model_settings.MODEL],
                   cfg[model_settings.MODEL_DIR])

    def _count(self, text: str) -> int | None:
        with self._load_lock:
            if self._profile is None and not self._missing:
                try:
                    self._profile = profile.load_spec(self._model, self._model_dir)
                except assets.ModelMissing:
                    self._missing = True
                    log.warning("message_tokens_uncounted", reason="no model file; chat checks the prompt")
        return count_message_tokens(self._profile, text) if self._profile is not None else None

    async def check(self, text: str, what: str = "the message") -> None:
        """Raises a 400 `message_too_long` ApiError naming the limit when `text` is over the policy."""
        try:
            size = self.policy.check_bytes(text, what)
            if size <= self.limit:
                return
            async with self._one_at_a_time:
                tokens = await asyncio.to_thread(self._count, text)
            if tokens is not None:
                self.policy.check_tokens(tokens, self.input_tokens)
        except MessageTooLong as err:
            raise too_long(err) from None
