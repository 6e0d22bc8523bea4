"""The served model's profile as the context builder's renderer and counter (chatmesh.model.profile): chat renders
prompts, counts messages and summaries with the same tokenizer and chat format the engines serve, chosen by
CHATMESH_MODEL.

Rendering goes through the profile's format (the model's own Jinja template split into prefix-stable segments,
or a built-in ChatML / Llama 3 format), so prompt n+1 starts with prompt n plus reply n (I3) for every supported
template. Every turn re-renders the whole history; the profile's encoder keeps each text piece's ids in a bounded
LRU (template.PromptEncoder), so only the new message is tokenized and the ids are those a fresh encode gives.
"""

from __future__ import annotations

from collections.abc import Sequence

from chatmesh.chat.context import Rendered, Speaker
from chatmesh.mesh import errors
from chatmesh.model.profile import ModelProfile
from chatmesh.model.template import FormatError, Message
from chatmesh.model.tools import ToolDefinition, ToolsUnsupported, ToolSyntax


class ProfileRenderer:
    def __init__(self, profile: ModelProfile):
        self.profile = profile

    def render(self, messages: Sequence[Message | tuple[Speaker, str]], tools: Sequence[ToolDefinition] = (),
               prefill: str = "") -> Rendered:
        try:
            out = self.profile.render(messages, tools=tools, prefill=prefill)
        except (ToolsUnsupported, FormatError) as err:  # the caller's tools or history, not an outage
            raise errors.InvalidArgument(str(err)) from None
        return Rendered(out.token_ids, out.platform_prefix_len)

    def tool_syntax(self) -> ToolSyntax:
        """How the served model writes tool calls; InvalidArgument, naming the model, when it has none."""
        try:
            return self.profile.tool_syntax
        except ToolsUnsupported as err:
            raise errors.InvalidArgument(str(err)) from None

    def count(self, text: str) -> int:
        return self.profile.count(text)

    def continuation(self, text: str) -> tuple[int, ...]:
        """Reply text already delivered, as the tokens that follow the generation prompt (a takeover)."""
        return tuple(self.profile.encode(text))
