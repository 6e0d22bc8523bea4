"""Chat formats rendered straight to token ids with stable prefixes: the built-in ChatML and Llama 3 formats here,
the model's own Jinja `chat_template` in jinja_template.py.

A format turns messages into segments: special tokens (by their text, looked up in the tokenizer's specials)
and plain-text pieces. `encode` encodes every text piece on its own and concatenates, with special ids inserted
as ids. Why per piece (invariant I3): the engine reuses a conversation's cached KV blocks only if the next
turn's prompt tokens START WITH the previous turn's, and tokenizing the rendered string whole would not
guarantee that (BPE may merge across a message boundary). Why special tokens are never parsed out of text:
message content is user text, and `<|im_end|>` typed by a user must stay characters, not end a turn.

Where this differs from tokenizing the rendered text whole (the boundary splits the prefix rule requires):
- ChatML (SmolLM2's template): a message's role header (`user\\n`), its content and the trailing `\\n` are
  three pieces, so the generation prompt `<|im_start|>assistant\\n` of turn n is also the exact start of the
  assistant message in turn n+1. Whole-text tokenizing differs only when content starts with whitespace, which
  then is not merged into the newline before it: the model sees the same characters.
- Llama 3: content is trimmed by the format (as Meta's template does), every piece sits between special tokens
  or after `\\n\\n`, and Llama 3's pre-tokenizer always ends a piece at a newline run followed by a
  non-space, so the ids equal whole-text tokenizing exactly (tests/model/test_llama3.py checks 10 turns).
- Either: a special token spelled inside content stays text (whole-text tokenizing would make it the token).

`platform_prefix_len` counts the tokens up to the end of the first (system) message: the platform prefix the
engine shares across owners (the owner's salt enters the block hash chain after it).

Built-in formats:
- `ChatML(default_system)`: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, generation prompt
  `<|im_start|>assistant\\n`; with `default_system`, a conversation without a leading system message gets it
  (SmolLM2's template does).
- `Llama3(dated=True)`: Llama 3.1's format (the same for 3.2 and 3.3): `<|begin_of_text|>`, always a system
  header whose body starts `Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n` (the
  template's fixed default date: a date that changed daily would change the shared prefix every day), then
  `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content | trim}<|eot_id|>` per message, generation prompt
  `<|start_header_id|>assistant<|end_header_id|>\\n\\n`. `dated=False`: Llama 3.0's, no implied system message.

Tools (tools.py). `format(..., tools=...)` with tool definitions, and messages carrying an assistant's tool calls
or a tool's result (role TOOL):
- Llama 3.1 renders them as Meta's template does, byte for byte (tests/model/test_llama3_tools.py checks): the
  system header gains `Environment: ipython\\n`; the definitions (each `json.dumps(indent=4)`) go into the first
  message after the system one, inside a user header, after Meta's instructions; an assistant's call is
  `{"name": N, "parameters": ARGS}` (one per message, as Meta's template allows); a result is an `ipython`
  message whose content is JSON-quoted (Meta's template applies `tojson` to it: a string is iterable to Jinja).
  The system header's extra line is platform text, so the platform prefix (the system message) still holds no
  client data; the definitions come after it. Llama 3.0 has no tool format: ToolsUnsupported.
- ChatML renders them in the Hermes / Qwen2.5 convention (tools.py): a system message of its own after the first
  one (so the platform prefix is unchanged), `<tool_call>` blocks in the assistant's text, `<tool_response>`
  blocks in a user message.
Definitions, calls and results are text pieces like any content: a special token spelled in them stays text.
"""

from __future__ import annotations

import enum
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from chatmesh.model.tools import (
    HERMES, LLAMA_JSON, ToolCall, ToolDefinition, ToolSyntax, ToolsUnsupported, hermes_reply_text,
    hermes_results_text, hermes_tools_text,
)
from chatmesh.model.vocabulary import TextTokenizer

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class Role(enum.Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"  # a tool's result, answering the call `tool_call_id` of the assistant message before it


@dataclass(frozen=True)
class Message:
    role: Role
    text: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls (its text, if any, came before them)
    tool_call_id: str = ""  # a TOOL message: the call it answers


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: tuple[int, ...]
    platform_prefix_len: int  # leading tokens that are the system message


@dataclass(frozen=True)
class Special:
    """A special token, by its text."""

    token: str


@dataclass(frozen=True)
class Text:
    """Plain text, encoded on its own."""

    text: str


Segment = Special | Text


@dataclass(frozen=True)
class Formatted:
    segments: tuple[Segment, ...]
    prefix_segments: int  # leading segments that are the platform prefix


class ChatFormat(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def end_of_turn(self) -> str:
        """The special token that closes an assistant message (a stop token)."""
        ...

    @property
    def tool_syntax(self) -> ToolSyntax | None:
        """How this format writes and reads tool calls; None: it has none (tools are refused)."""
        ...

    def format(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               tools: Sequence[ToolDefinition] = ()) -> Formatted: ...


class FormatError(ValueError):
    """A format cannot be used with this tokenizer or these messages."""


def as_messages(messages: Sequence[Message | tuple[Role | str, str]]) -> list[Message]:
    return [m if isinstance(m, Message) else Message(Role(m[0]) if isinstance(m[0], str) else m[0], m[1])
            for m in messages]


def uses_tools(messages: Sequence[Message], tools: Sequence[ToolDefinition]) -> bool:
    return bool(tools) or any(m.role is Role.TOOL or m.tool_calls for m in messages)


def hermes_lowered(messages: Sequence[Message], tools: Sequence[ToolDefinition]) -> list[Message]:
    """Messages with tools in the ChatML convention as plain system/user/assistant messages: the definitions as a
    system message after the first system one, calls as `<tool_call>` text, each run of results as one user
    message of `<tool_response>` blocks."""
    out: list[Message] = []
    results: list[str] = []
    for m in messages:
        if m.role is Role.TOOL:
            results.append(m.text)
            continue
        if results:
            out.append(Message(Role.USER, hermes_results_text(results)))
            results = []
        out.append(Message(m.role, hermes_reply_text(m.text, m.tool_calls)) if m.tool_calls else m)
    if results:
        out.append(Message(Role.USER, hermes_results_text(results)))
    if tools:
        at = 1 if out and out[0].role is Role.SYSTEM else 0
        out.insert(at, Message(Role.SYSTEM, hermes_tools_text(tools)))
    return out


class ChatML:
    name = "chatml"
    end_of_turn = "<|im_end|>"
    tool_syntax: ToolSyntax | None = HERMES

    def __init__(self, default_system: str | None = None):
        self.default_system = default_system

    def message(self, m: Message) -> list[Segment]:
        return [Special("<|im_start|>"), Text(m.role.value + "\n"), Text(m.text), Special("<|im_end|>"), Text("\n")]

    def format(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               tools: Sequence[ToolDefinition] = ()) -> Formatted:
        msgs = list(messages)
        if uses_tools(msgs, tools):
            msgs = hermes_lowered(msgs, tools)
        if self.default_system is not None and (not msgs or msgs[0].role is not Role.SYSTEM):
            msgs.insert(0, Message(Role.SYSTEM, self.default_system))
        segments: list[Segment] = []
        prefix = 0
        for i, m in enumerate(msgs):
            segments.extend(self.message(m))
            if i == 0 and m.role is Role.SYSTEM:
                prefix = len(segments)
        if add_generation_prompt:
            segments += [Special("<|im_start|>"), Text(Role.ASSISTANT.value + "\n")]
        return Formatted(tuple(segments), prefix)


LLAMA3_DATE_LINES = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"


LLAMA31_ENVIRONMENT = "Environment: ipython\n"
LLAMA31_TOOLS_HEAD = ("Given the following functions, please respond with a JSON for a function call with its proper "
                      "arguments that best answers the given prompt.\n\n"
                      'Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                      'its value}.Do not use variables.\n\n')


class Llama3:
    end_of_turn = "<|eot_id|>"

    def __init__(self, dated: bool = True):
        self.dated = dated

    @property
    def name(self) -> str:
        return "llama3.1" if self.dated else "llama3"

    @property
    def tool_syntax(self) -> ToolSyntax | None:
        return LLAMA_JSON if self.dated else None

    @staticmethod
    def header(role: str) -> list[Segment]:
        return [Special("<|start_header_id|>"), Text(role), Special("<|end_header_id|>")]

    def message(self, role: str, text: str, lead: str = "") -> list[Segment]:
        return [*self.header(role), Text("\n\n" + lead), Text(text.strip()), Special("<|eot_id|>")]

    def format(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               tools: Sequence[ToolDefinition] = ()) -> Formatted:
        if not self.dated and uses_tools(messages, tools):
            raise ToolsUnsupported("Llama 3.0's chat format has no tool calls")
        segments: list[Segment] = [Special("<|begin_of_text|>")]
        rest = list(messages)
        prefix = 0
        if self.dated:
            system = rest.pop(0).text if rest and rest[0].role is Role.SYSTEM else ""
            lead = (LLAMA31_ENVIRONMENT if tools else "") + LLAMA3_DATE_LINES
            segments += self.message(Role.SYSTEM.value, system, lead)
            prefix = len(segments)
        elif rest and rest[0].role is Role.SYSTEM:
            segments += self.message(Role.SYSTEM.value, rest.pop(0).text)
            prefix = len(segments)
        if tools:  # Meta's template: the definitions open the first message after the system one
            if not rest:
                raise FormatError("Llama 3.1 puts tool definitions in the first user message, and there is none")
            defs = "".join(json.dumps(t.as_object(), ensure_ascii=False, indent=4) + "\n\n" for t in tools)
            segments += [*self.header(Role.USER.value), Text("\n\n" + LLAMA31_TOOLS_HEAD + defs),
                         Text(rest.pop(0).text.strip()), Special("<|eot_id|>")]
        for m in rest:
            if m.role is Role.TOOL:
                segments += [*self.header("ipython"), Text("\n\n"), Text(json.dumps(m.text, ensure_ascii=False)),
                             Special("<|eot_id|>")]
            elif m.tool_calls:
                if len(m.tool_calls) != 1:
                    raise ToolsUnsupported("Llama 3.1's format takes one tool call per assistant message "
                                           f"(this one has {len(m.tool_calls)})")
                call = m.tool_calls[0]
                segments += [*self.header(Role.ASSISTANT.value), Text("\n\n"),
                             Text(LLAMA_JSON.call_text(call.name, call.arguments)), Special("<|eot_id|>")]
            else:
                segments += self.message(m.role.value, m.text)
        if add_generation_prompt:
            segments += [*self.header(Role.ASSISTANT.value), Text("\n\n")]
        return Formatted(tuple(segments), prefix)


CACHED_TEXTS = 4096  # text pieces whose ids are kept (a few conversations' worth of history per process)
CACHED_TEXT_CHARS = 64 * 1024  # longer texts (pastes) are encoded each time rather than pinned in memory


class PromptEncoder:
    """Encodes formatted segments to ids. Every turn re-renders the whole history, and all of it but the new
    message was encoded on an earlier turn, so text pieces' ids are kept in a bounded LRU; the result is the
    same ids as encoding each piece afresh (only the work is skipped)."""

    def __init__(self, tokenizer: TextTokenizer, cached_texts: int = CACHED_TEXTS):
        self.tokenizer = tokenizer
        self.cached_texts = cached_texts
        self._texts: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def special_id(self, token: str) -> int:
        i = self.tokenizer.special_tokens.get(token)
        if i is None:
            raise FormatError(f"the tokenizer has no special token {token}")
        return i

    def text_ids(self, text: str) -> tuple[int, ...]:
        ids = self._texts.get(text)
        if ids is not None:
            self._texts.move_to_end(text)
            return ids
        ids = tuple(self.tokenizer.encode(text)) if text else ()
        if len(text) <= CACHED_TEXT_CHARS:
            self._texts[text] = ids
            if len(self._texts) > self.cached_texts:
                self._texts.popitem(last=False)
        return ids

    def encode(self, formatted: Formatted) -> RenderedPrompt:
        ids: list[int] = []
        prefix = 0
        for i, seg in enumerate(formatted.segments):
            if i == formatted.prefix_segments:
                prefix = len(ids)
            match seg:
                case Special():
                    ids.append(self.special_id(seg.token))
                case Text():
                    ids.extend(self.text_ids(seg.text))
        if formatted.prefix_segments >= len(formatted.segments):
            prefix = len(ids)
        return RenderedPrompt(tuple(ids), prefix)


# SmolLM2's ChatML as functions of a tokenizer (the first version of this module's API, kept for the benchmarks
# and the local engine's tests, which render SmolLM2 prompts without a profile).
SMOLLM2_FORMAT = ChatML(DEFAULT_SYSTEM)


def message_ids(tok: TextTokenizer, message: Message) -> list[int]:
    """One message's tokens: `<|im_start|>` + role header + content + `<|im_end|>` + newline."""
    enc = PromptEncoder(tok, cached_texts=0)
    return list(enc.encode(Formatted(tuple(SMOLLM2_FORMAT.message(message)), 0)).token_ids)


def generation_prompt_ids(tok: TextTokenizer) -> list[int]:
    """`<|im_start|>assistant\\n`: the start of the reply the model is asked to write."""
    enc = PromptEncoder(tok, cached_texts=0)
    return list(enc.encode(Formatted((Special("<|im_start|>"), Text(Role.ASSISTANT.value + "\n")), 0)).token_ids)


def render(tok: TextTokenizer, messages: Sequence[Message | tuple[Role | str, str]],
           add_generation_prompt: bool = True) -> RenderedPrompt:
    """Token ids of a conversation in SmolLM2's ChatML. Without a leading system message the default one."""
    return PromptEncoder(tok, cached_texts=0).encode(SMOLLM2_FORMAT.format(as_messages(messages),
                                                                            add_generation_prompt))
