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
turn's prompt (I3). The platform prefix is the rendering of the first (system) message alone, if the full
rendering starts with it; otherwise nothing is shared across owners.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from chatmesh.model.template import FormatError, Formatted, Message, Role, Segment, Special, Text

_OPEN, _CLOSE = "\ue000", "\ue001"
_PAD = "\t\n \t"


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


class JinjaFormat:
    name = "jinja"

    def __init__(self, source: str, special_tokens: Sequence[str], end_of_turn: str,
                 variables: Mapping[str, str] | None = None):
        """`special_tokens`: the texts to split out of template text; `variables`: bos_token, eos_token, ..."""
        try:
            self._template = _compile(source)
        except TemplateError as err:
            raise FormatError(f"chat_template does not compile: {err}") from None
        self._variables = dict(variables or {})
        self._nonce = secrets.token_hex(8)
        pad = re.escape(_PAD)
        self._sentinel = re.compile(f"({pad})?{_OPEN}{self._nonce}(\\d+){_CLOSE}({pad})?")
        ordered = sorted(set(special_tokens), key=len, reverse=True)  # longest first: no token hides a longer one
        self._specials = re.compile("(" + "|".join(map(re.escape, ordered)) + ")") if ordered else None
        self.end_of_turn = end_of_turn

    def render_text(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The template's own output for these messages (what transformers' apply_chat_template prints)."""
        return self._render([{"role": m.role.value, "content": m.text} for m in messages], add_generation_prompt)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            text: str = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              **self._variables)
        except TemplateError as err:
            raise FormatError(f"chat_template: {err}") from None
        return text

    def format(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> Formatted:
        segments = self._segments(messages, add_generation_prompt)
        if messages and messages[0].role is Role.SYSTEM:
            alone = self._segments(messages[:1], False)
            if tuple(segments[:len(alone)]) == tuple(alone):
                return Formatted(tuple(segments), len(alone))
        return Formatted(tuple(segments), 0)

    def _segments(self, messages: Sequence[Message], add_generation_prompt: bool) -> list[Segment]:
        padded = [{"role": m.role.value, "content": f"{_PAD}{_OPEN}{self._nonce}{i}{_CLOSE}{_PAD}"}
                  for i, m in enumerate(messages)]
        out = self._render(padded, add_generation_prompt)
        segments: list[Segment] = []
        pos = 0
        expected = 0
        for match in self._sentinel.finditer(out):
            i = int(match.group(2))
            if i > expected:
                raise FormatError(f"chat_template leaves out the content of message {expected}")
            if i < expected:
                raise FormatError(f"chat_template prints the content of message {i} out of order or more than once")
            expected += 1
            self._template_text(out[pos:match.start()], segments)
            left, right = bool(match.group(1)), bool(match.group(3))
            text = messages[i].text
            if not left:
                text = text.lstrip()
            if not right:
                text = text.rstrip()
            segments.append(Text(text))
            pos = match.end()
        self._template_text(out[pos:], segments)
        if expected != len(messages):
            raise FormatError(f"chat_template leaves out the content of message {expected}")
        return segments

    def _template_text(self, text: str, segments: list[Segment]) -> None:
        if _OPEN in text or _CLOSE in text:
            raise FormatError("chat_template changes message contents (chatmesh renders only templates that "
                              "print them verbatim or trimmed)")
        parts = self._specials.split(text) if self._specials else [text]
        for k, part in enumerate(parts):
            if k % 2:
                segments.append(Special(part))
            elif part:
                segments.append(Text(part))
