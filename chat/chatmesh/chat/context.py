"""The context builder: the prompt for a turn, in a fixed order so the next turn hits the prefix cache (I3).

Order: the versioned system prompt (the platform prefix, shared across owners), then the stored summary of older
turns if there is one, then recent turns verbatim, then the new message. Nothing per-turn (no timestamp, no
retrieved snippet) goes before the new message, so prompt n+1 starts with prompt n plus reply n, token for token:
the renderer encodes each message on its own and concatenates them, so appending messages never re-tokenises what
came before.

What is replayed: complete and stopped replies exactly as the user saw them (a stopped reply's partial text);
not superseded replies (regenerate replaces them) and not turns blocked by moderation (blocked input never reaches
an engine, and a blocked reply's text is not fed back).

A summary covers messages [0, covers_until) and replaces them; it changes only at a turn boundary and is stored,
so two builds of the same turn give the same tokens.

Tools (issue 28): an assistant message keeps its tool calls, a stored tool message (one turn's input: the results
of the calls before it) is replayed as one tool message per result, and a turn may answer tool results instead of
a user message; the renderer writes them, and the turn's tool definitions, in the served model's own format. The
definitions are per turn (the caller sends them each time); the same ones keep the prompt prefix-stable.

The prompt's room (`prompt_room`): the model's context less the reply's token budget, within the configured
prompt cap; a prompt past it is `PromptTooLong`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from chatmesh.mesh.errors import InvalidArgument
from chatmesh.mesh.ids import TurnId
from chatmesh.model.template import Message
from chatmesh.model.template import Role as Speaker
from chatmesh.model.tools import ToolCall, ToolDefinition, ToolResult, ToolSyntax

__all__ = ["Speaker", "HistoryMessage", "PromptSummary", "Rendered", "Renderer", "PromptTooLong", "PromptLimits",
           "build", "messages_for", "history_tokens", "summary_cut", "as_prompt", "prompt_room"]


@dataclass(frozen=True)
class HistoryMessage:
    index: int
    speaker: Speaker
    content: str
    turn_id: TurnId
    replayable: bool  # False for superseded alternatives and blocked turns
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant message's calls
    tool_results: tuple[ToolResult, ...] = ()  # a tool message's results

    def prompt_messages(self) -> list[Message]:
        return as_prompt(self.speaker, self.content, self.tool_calls, self.tool_results)


def as_prompt(speaker: Speaker, content: str, calls: tuple[ToolCall, ...] = (),
              results: tuple[ToolResult, ...] = ()) -> list[Message]:
    """A stored message as the prompt's messages: a tool message is one message per result."""
    if speaker is Speaker.TOOL:
        return [Message(Speaker.TOOL, r.content, tool_call_id=r.tool_call_id) for r in results]
    return [Message(speaker, content, calls)]


@dataclass(frozen=True)
class PromptSummary:
    text: str
    covers_until: int  # messages with index < covers_until are replaced by the summary


@dataclass(frozen=True)
class Rendered:
    token_ids: tuple[int, ...]
    platform_prefix_tokens: int  # leading tokens of the system prompt, shared across owners


class Renderer(Protocol):
    """Turns messages into prompt tokens ending with the assistant's generation prompt (and `prefill`, the start
    of the reply), with `tools` in the served model's own format; InvalidArgument when it has none."""

    def render(self, messages: Sequence[Message | tuple[Speaker, str]], tools: Sequence[ToolDefinition] = (),
               prefill: str = "") -> Rendered: ...

    def tool_syntax(self) -> ToolSyntax:
        """How the served model writes tool calls; InvalidArgument, naming the model, when it has none."""
        ...

    def continuation(self, text: str) -> tuple[int, ...]:
        """The tokens of reply text already delivered, appended after the generation prompt so the engine
        continues that reply (a turn taken over mid-reply, `claimed.py`)."""
        ...


class PromptTooLong(InvalidArgument):
    """The prompt would not fit the model's context or the configured cap."""


@dataclass(frozen=True)
class PromptLimits:
    context_tokens: int
    prompt_cap_tokens: int
    reply_tokens: int


SUMMARY_HEADER = "Summary of the earlier conversation:\n"


def messages_for(system_prompt: str, summary: PromptSummary | None, history: Sequence[HistoryMessage],
                 new_message: str | None, instructions: str = "", new_results: Sequence[ToolResult] = ()
                 ) -> list[Message]:
    """The prompt's messages in their fixed order. `new_message` None (and no `new_results`, a tool turn's input)
    means regenerate: end after the history. `instructions` (this turn's only, never stored) go just before the
    new input, after everything stable, unless they are the conversation's own first message (then they are
    already at the top)."""
    out: list[Message] = [Message(Speaker.SYSTEM, system_prompt)]
    start = 0
    if summary is not None:
        out.append(Message(Speaker.SYSTEM, SUMMARY_HEADER + summary.text))
        start = summary.covers_until
    for m in history:
        if m.index >= start and m.replayable:
            out += m.prompt_messages()
    own = history[0].content if history and history[0].speaker is Speaker.SYSTEM else None
    if instructions and instructions != own:
        out.append(Message(Speaker.SYSTEM, instructions))
    if new_results:
        out += as_prompt(Speaker.TOOL, "", (), tuple(new_results))
    elif new_message is not None:
        out.append(Message(Speaker.USER, new_message))
    return out


def prompt_room(limits: PromptLimits, reply_tokens: int | None = None) -> int:
    """The most prompt tokens a turn may send: the context less the reply's budget, within the prompt cap."""
    return min(limits.prompt_cap_tokens, limits.context_tokens - (reply_tokens or limits.reply_tokens))


def build(renderer: Renderer, limits: PromptLimits, system_prompt: str, summary: PromptSummary | None,
          history: Sequence[HistoryMessage], new_message: str | None, instructions: str = "",
          reply_tokens: int | None = None, new_results: Sequence[ToolResult] = (),
          tools: Sequence[ToolDefinition] = (), prefill: str = "") -> Rendered:
    rendered = renderer.render(messages_for(system_prompt, summary, history, new_message, instructions, new_results),
                               tools, prefill)
    n = len(rendered.token_ids)
    room = prompt_room(limits, reply_tokens)
    if n > room:
        raise PromptTooLong(
            f"the prompt is {n} tokens; the limit is {room} (model context {limits.context_tokens} minus "
            f"{limits.reply_tokens} reply tokens, cap {limits.prompt_cap_tokens}): shorten the message or start a "
            "new conversation")
    return rendered


def history_tokens(history: Sequence[HistoryMessage], summary: PromptSummary | None, count: dict[int, int]) -> int:
    """Tokens of the replayed history after the summary (count: message index -> token count)."""
    start = summary.covers_until if summary else 0
    return sum(count.get(m.index, 0) for m in history if m.index >= start and m.replayable)


def summary_cut(history: Sequence[HistoryMessage], summary: PromptSummary | None, keep_recent: int) -> int | None:
    """Where a new summary should end (exclusive message index), keeping `keep_recent` messages verbatim and never
    splitting a user message from its reply (0: everything is summarised); None when there is nothing new to
    summarise."""
    start = summary.covers_until if summary else 0
    live = [m for m in history if m.index >= start]
    if not live:
        return None
    if keep_recent <= 0:
        return live[-1].index + 1
    if len(live) <= keep_recent:
        return None
    cut_at = live[len(live) - keep_recent]
    # Start the verbatim tail at a user message, so the summary ends at a turn boundary.
    tail = [m for m in live if m.index >= cut_at.index]
    while tail and tail[0].speaker is not Speaker.USER:
        tail = tail[1:]
    if not tail:
        return None
    return tail[0].index if tail[0].index > start else None
