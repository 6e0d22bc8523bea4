"""The model's own Jinja `chat_template` (tokenizer_config.json, chat_template.jinja, or a GGUF's
`tokenizer.chat_template`) as a `ChatFormat`, rendered sandboxed and split into segments that keep I3.

Rendering: Jinja2's `ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, a `raise_exception`
global and a `tojson` filter, as transformers' `apply_chat_template` does; no `strftime_now`, so templates that
would print today's date (Llama 3.2's) print their fixed default instead and the prefix stays the same every day.

Segments: rendering the real text and tokenizing it would let content spell special tokens and merge across
message boundaries (see template.py). So each message's content is replaced by a sentinel (private-use
characters around a per-process random nonce and the message's index, padded each side with `\t\n \t`, a run
of whitespace no template prints beside content) and the
template is rendered once; the output is split at the sentinels. Template text between them is split at the
tokenizer's special-token texts (they become ids) and the rest encoded as text pieces; each sentinel becomes
its message's content as a text piece. Whether the template trims content shows in the output (the padding
survives or not) and is applied the same way to the real content.

What a template must do for this to hold (checked on probe conversations when the profile loads, else the
profile is refused with the reason): print each message's content once, verbatim or trimmed, in message
order, without branching on the content's text; render the next turn's prompt so that it starts with this
turn's prompt (I3). The platform prefix is the rendering of the first (system) message alone (without tools),
if the full rendering starts with it; otherwise nothing is shared across owners.

Tools. A template that reads `tools` (Llama 3.1's, Qwen's) is given the definitions, the assistants' calls
(`tool_calls`, arguments as objects, as transformers passes them) and `tool` messages, and its output is split as
above. Three more things hold then: a message with calls may leave its content out (the call is the message); a
content the template prints through `tojson` (Meta's template does so with a tool's result) is recognised by its
escaped sentinel and becomes that content's JSON string text; and a definition, name or argument string that
spells one of the tokenizer's special tokens is itself replaced by a sentinel before rendering and printed back as
text (raw, or JSON-escaped where the template applied `tojson`), so client data never becomes a special token.
Which syntax reads the calls back is seen in the template (`<tool_call>`: Hermes; `"parameters"` with Llama's
headers: Llama 3.1 JSON), else tools are refused. A ChatML template without a tools branch (SmolLM2's) gets
the Hermes convention as plain messages (template.hermes_lowered).
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import meta
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from chatmesh.model.template import (
    FormatError, Formatted, Message, Role, Segment, Special, Text, hermes_lowered, uses_tools,
)
from chatmesh.model.tools import HERMES, LLAMA_JSON, ToolDefinition, ToolSyntax, ToolsUnsupported

_OPEN, _CLOSE = "\ue000", "\ue001"  # a message's content
_VOPEN, _VCLOSE = "\ue002", "\ue003"  # a tool string that spells a special token
_PAD = "\t\n \t"
_MARK = "\x01"  # inside every sentinel: printed raw it stays, through tojson it becomes \\u0001
_JSON_PAD = json.dumps(_PAD)[1:-1]
_JSON_MARK = json.dumps(_MARK)[1:-1]


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    return _env().from_string(source)


def _reads_tools(source: str) -> bool:
    return "tools" in meta.find_undeclared_variables(_env().parse(source))


def _syntax_of(source: str, reads_tools: bool) -> ToolSyntax | None:
    if reads_tools:
        if "<tool_call>" in source:
            return HERMES
        if '"parameters"' in source and "<|start_header_id|>" in source:
            return LLAMA_JSON
        return None
    return HERMES if "<|im_start|>" in source else None


class JinjaFormat:
    name = "jinja"

    def __init__(self, source: str, special_tokens: Sequence[str], end_of_turn: str,
                 variables: Mapping[str, str] | None = None):
        """`special_tokens`: the texts to split out of template text; `variables`: bos_token, eos_token, ..."""
        try:
            self._template = _compile(source)
            self._reads_tools = _reads_tools(source)
        except TemplateError as err:
            raise FormatError(f"chat_template does not compile: {err}") from None
        self._variables = dict(variables or {})
        self._nonce = secrets.token_hex(8)
        pad, json_pad = re.escape(_PAD), re.escape(_JSON_PAD)
        mark = f"({re.escape(_MARK)}|{re.escape(_JSON_MARK)})"
        side = f"({pad}|{json_pad})?"
        self._sentinel = re.compile(f"{side}{_OPEN}{self._nonce}(\\d+){mark}{_CLOSE}{side}")
        self._value = re.compile(f"{_VOPEN}{self._nonce}(\\d+){mark}{_VCLOSE}")
        ordered = sorted(set(special_tokens), key=len, reverse=True)  # longest first: no token hides a longer one
        self._specials = re.compile("(" + "|".join(map(re.escape, ordered)) + ")") if ordered else None
        self.end_of_turn = end_of_turn
        self.tool_syntax: ToolSyntax | None = _syntax_of(source, self._reads_tools)
        self.tools_problem = "" if self.tool_syntax else "its chat template has no tool-call format chatmesh reads"
        self._gen: tuple[Segment, ...] | None = None

    def render_text(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    tools: Sequence[ToolDefinition] = ()) -> str:
        """The template's own output for these messages (what transformers' apply_chat_template prints)."""
        if uses_tools(messages, tools) and not self._reads_tools:
            messages = hermes_lowered(messages, tools)
            tools = ()
        return self._render([self._message(m, m.text) for m in messages], add_generation_prompt,
                            [t.as_object() for t in tools] if tools else None)

    @staticmethod
    def _message(m: Message, content: str, value: Any = None) -> dict[str, Any]:
        out: dict[str, Any] = {"role": m.role.value, "content": content}
        keep = value or (lambda v: v)
        if m.tool_calls:
            out["tool_calls"] = [{"id": keep(c.id), "type": "function",
                                  "function": {"name": keep(c.name), "arguments": keep(c.arguments_object())}}
                                 for c in m.tool_calls]
        if m.role is Role.TOOL and m.tool_call_id:
            out["tool_call_id"] = keep(m.tool_call_id)
        return out

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[Any] | None) -> str:
        extra: dict[str, Any] = {"tools": tools} if tools is not None else {}
        try:
            text: str = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              **self._variables, **extra)
        except TemplateError as err:
            raise FormatError(f"chat_template: {err}") from None
        return text

    def format(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               tools: Sequence[ToolDefinition] = ()) -> Formatted:
        if uses_tools(messages, tools):
            if self.tool_syntax is None:
                raise ToolsUnsupported(self.tools_problem)
            if not self._reads_tools:
                messages, tools = hermes_lowered(messages, tools), ()
        segments = self._segments(messages, add_generation_prompt, tools)
        if messages and messages[0].role is Role.SYSTEM:
            alone = self._segments(messages[:1], False, ())
            if tuple(segments[:len(alone)]) == tuple(alone):
                return Formatted(tuple(segments), len(alone))
        return Formatted(tuple(segments), 0)

    def _segments(self, messages: Sequence[Message], add_generation_prompt: bool,
                  tools: Sequence[ToolDefinition]) -> list[Segment]:
        values: list[str] = []
        protect = self._protector(values)
        padded = [self._message(m, f"{_PAD}{_OPEN}{self._nonce}{i}{_MARK}{_CLOSE}{_PAD}", protect)
                  for i, m in enumerate(messages)]
        out = self._render(padded, add_generation_prompt, [protect(t.as_object()) for t in tools] if tools else None)
        segments: list[Segment] = []
        pos = 0
        expected = 0
        for match in self._sentinel.finditer(out):
            i = int(match.group(2))
            while expected < i and messages[expected].tool_calls:  # a call may stand for its message's content
                expected += 1
            if i > expected:
                raise FormatError(f"chat_template leaves out the content of message {expected}")
            if i < expected:
                raise FormatError(f"chat_template prints the content of message {i} out of order or more than once")
            expected += 1
            start, end = match.start(), match.end()
            left, right = bool(match.group(1)), bool(match.group(4))
            text = messages[i].text
            if not left:
                text = text.lstrip()
            if not right:
                text = text.rstrip()
            if match.group(3) == _JSON_MARK:  # printed through tojson: the content as a JSON string, quotes and all
                text = json.dumps(text, ensure_ascii=False)
                if out[start - 1:start] != '"' or out[end:end + 1] != '"':
                    raise FormatError("chat_template prints a message's content inside other JSON")
                start, end = start - 1, end + 1
            self._template_text(out[pos:start], segments, values)
            segments.append(Text(text))
            pos = end
        self._template_text(out[pos:], segments, values)
        while expected < len(messages) and messages[expected].tool_calls:
            expected += 1
        if expected != len(messages):
            raise FormatError(f"chat_template leaves out the content of message {expected}")
        return self._split_replies(segments) if any(m.tool_calls for m in messages) else segments

    def _split_replies(self, segments: list[Segment]) -> list[Segment]:
        """An assistant message that is a call has no content piece, so its text follows the template's header
        text in one piece; split it where the generation prompt ends, so the next prompt starts with this one's
        segment for segment (I3), as it does for replies with content."""
        gen = self._generation_prompt()
        if len(gen) < 2 or not isinstance(gen[-1], Text) or not any(isinstance(g, Special) for g in gen):
            return segments
        head, tail = list(gen[:-1]), gen[-1].text
        out: list[Segment] = []
        for seg in segments:
            if (isinstance(seg, Text) and len(seg.text) > len(tail) and seg.text.startswith(tail)
                    and out[-len(head):] == head):
                out += [Text(tail), Text(seg.text[len(tail):])]
            else:
                out.append(seg)
        return out

    def _generation_prompt(self) -> tuple[Segment, ...]:
        """The segments the template adds for `add_generation_prompt` (after a one-message conversation)."""
        if self._gen is None:
            probe = [Message(Role.USER, "x")]
            with_gen, without = self._segments(probe, True, ()), self._segments(probe, False, ())
            self._gen = tuple(with_gen[len(without):]) if with_gen[:len(without)] == without else ()
        return self._gen

    def _protector(self, values: list[str]) -> Any:
        """Replaces, inside tool data, each string that spells a special token by a value sentinel."""
        specials = self._specials

        def protect(value: Any) -> Any:
            if isinstance(value, str):
                if specials is None or not specials.search(value):
                    return value
                values.append(value)
                return f"{_VOPEN}{self._nonce}{len(values) - 1}{_MARK}{_VCLOSE}"
            if isinstance(value, dict):
                return {protect(k): protect(v) for k, v in value.items()}
            if isinstance(value, list):
                return [protect(v) for v in value]
            return value

        return protect

    def _template_text(self, text: str, segments: list[Segment], values: Sequence[str]) -> None:
        if _OPEN in text or _CLOSE in text:
            raise FormatError("chat_template changes message contents (chatmesh renders only templates that "
                              "print them verbatim or trimmed)")
        parts = self._specials.split(text) if self._specials else [text]
        for k, part in enumerate(parts):
            if k % 2:
                segments.append(Special(part))
            elif part:
                segments.append(Text(self._values_back(part, values)))

    def _values_back(self, text: str, values: Sequence[str]) -> str:
        if _VOPEN not in text:
            return text

        def back(match: re.Match[str]) -> str:
            value = values[int(match.group(1))]
            return json.dumps(value, ensure_ascii=False)[1:-1] if match.group(2) == _JSON_MARK else value

        out = self._value.sub(back, text)
        if _VOPEN in out or _VCLOSE in out:
            raise FormatError("chat_template changes tool definitions or calls (chatmesh renders only templates "
                              "that print them as given)")
        return out
