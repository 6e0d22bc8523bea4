"""Tool calling in the served model's own format: the values (definitions, calls, the caller's choice) and, per
format, how a reply's calls are written and read back.

A tool definition is kept as the client sent it (`definition_json`, the OpenAI `{"type": "function", "function":
{...}}` object, its key order kept), because a model's template prints it verbatim (Llama 3.1's `tojson(indent=4)`)
and the prompt must not change when the same tools come again (I3). A call's `arguments` is JSON object text, as
the OpenAI API carries it.

Two syntaxes, chosen by the model profile from its chat format (template.py, jinja_template.py):
- `LLAMA_JSON`, Llama 3.1's custom-tool format: the reply is one JSON object `{"name": N, "parameters": {...}}`
  ended by `<|eot_id|>` (Meta's template renders an assistant tool call that way). A reply that starts with `{`
  is held until it ends and read as a call if it is one; anything else is text. Meta's template renders one call
  per assistant message, so a reply carries at most one (`parallel` does not apply). `<|python_tag|>` marks
  Llama's built-in tools (`brave_search.call(...)`, code), which an OpenAI client never declares: the engine's
  text stream drops that special token, a JSON call after it still reads as a call, code stays text.
- `HERMES`, the ChatML convention (Hermes 2 Pro, Qwen2.5; what a SmolLM2-class ChatML model is given): calls as
  `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>` blocks, any number, after optional text; results
  come back in a user message as `<tool_response>` blocks; the definitions go in a system message of their own.

Reading a reply (`CallScanner`): text streams as it comes except what may be a call (a reply starting with `{`; a
`<tool_call>` block, and a tail that may be the start of its tag), which is held until it closes. A held part that
is not a well-formed call of a declared tool comes out as text at the end, so nothing the model wrote is lost.
`tool_choice` none reads no calls; required and a named tool start the reply with the call's opening (`prefill`),
since chatmesh has no constrained decoding: the model continues a call it cannot leave.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class ToolsUnsupported(ValueError):
    """The served model's format has no tool calls (or none chatmesh can read back); the message names it."""


@dataclass(frozen=True)
class ToolDefinition:
    """One tool the caller offers: its function name and the definition object as JSON text."""

    name: str
    definition_json: str

    def as_object(self) -> Any:
        return json.loads(self.definition_json)

    @staticmethod
    def of(definition: Any) -> ToolDefinition:
        """From an OpenAI chat-completions tool object (`{"type": "function", "function": {"name", ...}}`)."""
        return ToolDefinition(str(definition["function"]["name"]), json.dumps(definition, ensure_ascii=False))


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: an id (chatmesh's, `call_...`), the function name and its arguments (JSON object)."""

    id: str
    name: str
    arguments: str

    def arguments_object(self) -> Any:
        return json.loads(self.arguments)


@dataclass(frozen=True)
class ToolResult:
    """A tool's result as the client sent it back, answering the call `tool_call_id`."""

    tool_call_id: str
    content: str


class ChoiceMode(enum.Enum):
    AUTO = "auto"  # the model decides
    NONE = "none"  # no calls: the reply is text (the tools stay in the prompt, so it stays prefix-stable)
    REQUIRED = "required"  # the reply is a call of some declared tool
    NAMED = "named"  # the reply is a call of `ToolChoice.name`


@dataclass(frozen=True)
class ToolChoice:
    mode: ChoiceMode = ChoiceMode.AUTO
    name: str = ""  # with NAMED


AUTO = ToolChoice()


@dataclass(frozen=True)
class ParsedCall:
    """A call read out of a reply (chat gives it its id)."""

    name: str
    arguments: str  # JSON object text, normalised


Piece = str | ParsedCall


class CallScanner(Protocol):
    def feed(self, text: str) -> list[Piece]:
        """Reply text as it streams; what can go out now (text, calls)."""
        ...

    def finish(self) -> list[Piece]:
        """The reply ended: whatever was held, as calls or as text."""
        ...


def _arguments(value: Any) -> str | None:
    """A call's arguments as JSON object text; a JSON string holding an object counts (some models quote it)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call(obj: Any, names: frozenset[str], arg_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    raw: Any = next((obj[k] for k in arg_keys if k in obj), {})
    args = _arguments(raw)
    return None if args is None else ParsedCall(obj["name"], args)


def _names(tools: Sequence[ToolDefinition], choice: ToolChoice) -> frozenset[str]:
    if choice.mode is ChoiceMode.NAMED:
        return frozenset({choice.name})
    return frozenset(t.name for t in tools)


class _LlamaScanner:
    """Llama 3.1 JSON calls (module header): decided by the reply's first non-space character."""

    def __init__(self, names: frozenset[str]):
        self._names = names
        self._held = ""
        self._mode: bool | None = None  # None: undecided; True: a possible call (held); False: text

    def feed(self, text: str) -> list[Piece]:
        if self._mode is False:
            return [text] if text else []
        self._held += text
        if self._mode is None:
            head = self._held.lstrip()
            if not head:
                return []
            self._mode = head.startswith("{")
            if not self._mode:
                out, self._held = self._held, ""
                return [out]
        return []

    def finish(self) -> list[Piece]:
        held, self._held = self._held, ""
        if not held:
            return []
        if self._mode:
            decoder = json.JSONDecoder()
            body = held.strip()
            try:
                obj, end = decoder.raw_decode(body)
            except json.JSONDecodeError:
                return [held]
            call = _call(obj, self._names, ("parameters", "arguments"))
            if call is not None and not body[end:].strip(" ;\n"):
                return [call]
        return [held]


OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


class _HermesScanner:
    """`<tool_call>` blocks (module header). Whitespace at the end of text is held until more text follows, so
    the newline a model writes before a block is not sent as content (the stored reply renders it back)."""

    def __init__(self, names: frozenset[str], parallel: bool):
        self._names = names
        self._parallel = parallel
        self._buf = ""  # not yet decided: a possible tag start, or a block being read
        self._space = ""  # whitespace ending the text sent so far
        self._inside = False
        self._calls = 0

    def _text(self, text: str, out: list[Piece]) -> None:
        text = self._space + text
        head = text.rstrip()
        self._space = text[len(head):]
        if head:
            out.append(head)

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if not self._inside:
                at = self._buf.find(OPEN_TAG)
                if at < 0:
                    keep = max((k for k in range(1, len(OPEN_TAG)) if self._buf.endswith(OPEN_TAG[:k])), default=0)
                    self._text(self._buf[:len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._text(self._buf[:at], out)
                self._buf, self._inside = self._buf[at:], True
            end = self._buf.find(CLOSE_TAG)
            if end < 0:
                return out
            block, self._buf = self._buf[:end + len(CLOSE_TAG)], self._buf[end + len(CLOSE_TAG):]
            self._inside = False
            self._block(block, out)

    def _block(self, block: str, out: list[Piece]) -> None:
        if self._calls and not self._parallel:
            return  # one call asked for: later blocks are dropped
        try:
            obj = json.loads(block[len(OPEN_TAG):].removesuffix(CLOSE_TAG).strip())
        except json.JSONDecodeError:
            obj = None
        call = _call(obj, self._names, ("arguments", "parameters"))
        if call is None:
            self._text(block, out)
            return
        self._calls += 1
        self._space = ""
        out.append(call)

    def finish(self) -> list[Piece]:
        rest, self._buf = self._buf, ""
        out: list[Piece] = []
        if self._inside and rest.rstrip().endswith("}"):  # a block the reply did not close: a call if whole
            self._inside = False
            self._block(rest + CLOSE_TAG, out)
        elif rest:
            self._text(rest, out)
        if self._space and not self._calls:
            out.append(self._space)
        self._space = ""
        return out


class ToolSyntax(Protocol):
    """How one format writes calls and reads them back."""

    @property
    def name(self) -> str: ...

    def call_text(self, name: str, arguments: str) -> str:
        """A call as the model writes it (the sim engine's scripted calls, and the prefill's source)."""
        ...

    def prefill(self, choice: ToolChoice) -> str:
        """The start of the reply the prompt ends with, for required and named choices ("" otherwise)."""
        ...

    def scanner(self, tools: Sequence[ToolDefinition], choice: ToolChoice, parallel: bool) -> CallScanner: ...


class LlamaJson:
    name = "llama3.1-json"

    def call_text(self, name: str, arguments: str) -> str:
        """What Meta's template prints for an assistant tool call (and so what the model learned to write)."""
        return '{"name": "' + name + '", "parameters": ' + json.dumps(json.loads(arguments), ensure_ascii=False) + "}"

    def prefill(self, choice: ToolChoice) -> str:
        match choice.mode:
            case ChoiceMode.REQUIRED:
                return '{"name": "'
            case ChoiceMode.NAMED:
                return '{"name": "' + choice.name + '", "parameters": '
            case ChoiceMode.AUTO | ChoiceMode.NONE:
                return ""

    def scanner(self, tools: Sequence[ToolDefinition], choice: ToolChoice, parallel: bool) -> CallScanner:
        return _LlamaScanner(_names(tools, choice))


class Hermes:
    name = "hermes"

    def call_text(self, name: str, arguments: str) -> str:
        args = json.dumps(json.loads(arguments), ensure_ascii=False)
        return f'{OPEN_TAG}\n{{"name": "{name}", "arguments": {args}}}\n{CLOSE_TAG}'

    def prefill(self, choice: ToolChoice) -> str:
        match choice.mode:
            case ChoiceMode.REQUIRED:
                return OPEN_TAG + '\n{"name": "'
            case ChoiceMode.NAMED:
                return OPEN_TAG + '\n{"name": "' + choice.name + '", "arguments": '
            case ChoiceMode.AUTO | ChoiceMode.NONE:
                return ""

    def scanner(self, tools: Sequence[ToolDefinition], choice: ToolChoice, parallel: bool) -> CallScanner:
        return _HermesScanner(_names(tools, choice), parallel)


LLAMA_JSON = LlamaJson()
HERMES = Hermes()


class _NoCalls:
    def feed(self, text: str) -> list[Piece]:
        return [text] if text else []

    def finish(self) -> list[Piece]:
        return []


def hermes_tools_text(tools: Sequence[ToolDefinition]) -> str:
    """The system message that offers `tools` in the ChatML convention (Qwen2.5's wording)."""
    lines = "\n".join(json.dumps(t.as_object(), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{OPEN_TAG}{CLOSE_TAG} XML tags:\n{OPEN_TAG}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' + CLOSE_TAG)


def hermes_reply_text(text: str, calls: Sequence[ToolCall]) -> str:
    """An assistant message with calls, as the model wrote it in the ChatML convention."""
    blocks = "\n".join(HERMES.call_text(c.name, c.arguments) for c in calls)
    return f"{text}\n{blocks}" if text else blocks


def hermes_results_text(results: Sequence[str]) -> str:
    """Consecutive tool results as one user message of `<tool_response>` blocks."""
    return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)


def reply_scanner(syntax: ToolSyntax, tools: Sequence[ToolDefinition], choice: ToolChoice,
                  parallel: bool) -> CallScanner:
    """What reads one reply: no calls without tools or with tool_choice none, else the format's scanner."""
    if not tools or choice.mode is ChoiceMode.NONE:
        return _NoCalls()
    return syntax.scanner(tools, choice, parallel)
