"""The chat model's template as the context builder's renderer: SmolLM2's ChatML, encoded per message so prompts
stay prefix-stable (see chatmesh.model.template).

Every turn re-renders the whole history, and all of it but the new message was encoded on an earlier turn, so
each message's tokens are kept in a bounded LRU keyed by (role, text). The result is the same tokens
`template.render` gives (a test compares them); only the work is skipped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from chatmesh.chat.context import Rendered, Speaker
from chatmesh.model import template
from chatmesh.model.tokenizer import Tokenizer

CACHED_MESSAGES = 4096  # messages whose tokens are kept (a few conversations' worth of history per process)
CACHED_TEXT_CHARS = 64 * 1024  # longer texts (pastes) are encoded each time rather than pinned in memory


class ChatMLRenderer:
    def __init__(self, tokenizer: Tokenizer, cached_messages: int = CACHED_MESSAGES):
        self.tokenizer = tokenizer
        self.cached_messages = cached_messages
        self._messages: OrderedDict[tuple[Speaker, str], tuple[int, ...]] = OrderedDict()
        self._generation_prompt = tuple(template.generation_prompt_ids(tokenizer))

    def render(self, messages: Sequence[tuple[Speaker, str]]) -> Rendered:
        if not messages or messages[0][0] is not Speaker.SYSTEM:  # the template adds its default system message
            out = template.render(self.tokenizer, [template.Message(role, text) for role, text in messages])
            return Rendered(out.token_ids, out.platform_prefix_len)
        ids: list[int] = []
        prefix = 0
        for i, (role, text) in enumerate(messages):
            ids.extend(self._message_ids(role, text))
            if i == 0:
                prefix = len(ids)
        ids.extend(self._generation_prompt)
        return Rendered(tuple(ids), prefix)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def continuation(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text))

    def _message_ids(self, role: Speaker, text: str) -> tuple[int, ...]:
        key = (role, text)
        ids = self._messages.get(key)
        if ids is not None:
            self._messages.move_to_end(key)
            return ids
        ids = tuple(template.message_ids(self.tokenizer, template.Message(role, text)))
        if len(text) <= CACHED_TEXT_CHARS:
            self._messages[key] = ids
            if len(self._messages) > self.cached_messages:
                self._messages.popitem(last=False)
        return ids
