"""The chat model's template as the context builder's renderer: SmolLM2's ChatML, encoded per message so prompts
stay prefix-stable (see chatmesh.model.template)."""

from __future__ import annotations

from collections.abc import Sequence

from chatmesh.chat.context import Rendered, Speaker
from chatmesh.model import template
from chatmesh.model.tokenizer import Tokenizer


class ChatMLRenderer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def render(self, messages: Sequence[tuple[Speaker, str]]) -> Rendered:
        out = template.render(self.tokenizer, [template.Message(role, text) for role, text in messages])
        return Rendered(out.token_ids, out.platform_prefix_len)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))
