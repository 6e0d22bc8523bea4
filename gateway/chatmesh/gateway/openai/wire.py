"""Request bodies of the OpenAI-compatible surface: parsed into typed values, every field checked and named when
wrong (a 400 with OpenAI's `param`), nothing passed on that chatmesh would not honour.

Three kinds of keys: the ones chatmesh implements (parsed here); ones it does not, which are accepted only at
their no-op value (`n: 1`, `logprobs: false`, `frequency_penalty: 0`, `tools: []`, ...) and otherwise refused
naming the parameter; and unknown keys, refused too. A body that passes here is safe to act on: a bad request
stores nothing.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from chatmesh.gateway.openai.errors import OpenAIError, invalid, unsupported
from chatmesh.gateway.openai.tool_wire import (
    NO_TOOLS, Tools, chat_tools, item_call, item_output, message_calls, reject_legacy_functions, response_tools,
)
from chatmesh.model.tools import ToolCall

MAX_STOP = 4
MAX_STOP_CHARS = 64
MAX_MESSAGES = 10_000


class Role(enum.Enum):
    """Who wrote a message, as chatmesh stores it (OpenAI's `developer` is a system message)."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"  # a tool's result (Chat Completions' tool message, a Responses function_call_output item)


_ROLES = {"system": Role.SYSTEM, "developer": Role.SYSTEM, "user": Role.USER, "assistant": Role.ASSISTANT,
          "tool": Role.TOOL}


class Phase(enum.Enum):
    """An assistant message's Responses `phase`: a step's commentary, or the final answer. Kept with the message
    it came with (records.py) and sent back when the conversation's items are listed."""

    COMMENTARY = "commentary"
    FINAL_ANSWER = "final_answer"


PHASES = tuple(p.value for p in Phase)


@dataclass(frozen=True)
class Message:
    role: Role
    text: str
    phase: Phase | None = None  # an assistant message's Responses `phase`, as sent
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant message's calls
    tool_call_id: str = ""  # a TOOL message: the call whose result `text` is


@dataclass(frozen=True, slots=True)
class Input:
    """A request's messages split: the history before its input, and the input: the new user message
    (`content`), or the tool results (call id, output) it answers with instead."""

    history: tuple[Message, ...]
    content: str
    results: tuple[tuple[str, str], ...] = ()


def split_input(messages: tuple[Message, ...]) -> Input:
    """The input is the last message (a user's), or the run of tool results that ends the messages (answering
    the calls before them)."""
    start = len(messages) - 1
    while start > 0 and messages[start - 1].role is Role.TOOL:
        start -= 1
    if messages[-1].role is Role.TOOL:
        return Input(messages[:start], "", tuple((m.tool_call_id, m.text) for m in messages[start:]))
    return Input(messages[:-1], messages[-1].text)


@dataclass(frozen=True)
class Options:
    """Per-turn generation options; None: the service's default. (As chat takes them: `stored.options_pb`.)"""

    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None
    instructions: str = ""
    tools: Tools = NO_TOOLS
    compact_threshold: int | None = None  # summarise older turns past this many history tokens (Responses)


@dataclass(frozen=True)
class ChatRequest:
    """POST /chat/completions."""

    model: str
    messages: tuple[Message, ...]
    stream: bool
    include_usage: bool
    options: Options
    user: str | None

    @property
    def input(self) -> Input:
        return split_input(self.messages)


@dataclass(frozen=True)
class ResponseRequest:
    """POST /responses."""

    model: str
    items: tuple[Message, ...]
    instructions: str
    previous_response_id: str | None
    conversation: str | None
    store: bool
    stream: bool
    options: Options
    user: str | None
    raw_input: Any = field(compare=False, default=None)  # echoed nowhere; kept for the request digest
    compacted: str | None = None  # an input compaction item's encrypted_content: where the input continues
    compact_threshold: int | None = None  # context_management's compaction threshold, in tokens
    background: bool = False
    truncation: str = "disabled"
    metadata: dict[str, str] = field(default_factory=dict)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    tools: Tools = NO_TOOLS

    @property
    def input(self) -> Input:
        return split_input(self.items)


# ---- field checks ---------------------------------------------------------------------------------------------

def _type_error(param: str, expected: str) -> OpenAIError:
    return invalid(param, f"expected {expected}", "invalid_type")


def _string(body: Mapping[str, Any], name: str, *, required: bool = False, max_chars: int = 1 << 20,
            param: str | None = None) -> str | None:
    value = body.get(name)
    param = param or name
    if value is None:
        if required:
            raise invalid(param, "is required", "missing_required_parameter")
        return None
    if not isinstance(value, str):
        raise _type_error(param, "a string")
    if len(value) > max_chars:
        raise invalid(param, f"longer than {max_chars} characters", "string_above_max_length")
    return value


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean")
    return value


def _number(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _type_error(name, "a number")
    if not low <= value <= high:
        raise invalid(name, f"must be between {low:g} and {high:g}")
    return float(value)


def _integer(body: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer")
    if not low <= value <= high:
        raise invalid(name, f"must be between {low} and {high}")
    return value


def _is_empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


# Parameters chatmesh does not implement, with the values that mean "not used" (so a client sending defaults works).
_NO_OP: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v is None or v == 1,
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: v is None or v == 0,
    "frequency_penalty": lambda v: v is None or v == 0,
    "presence_penalty": lambda v: v is None or v == 0,
    "logit_bias": _is_empty,
    "functions": _is_empty,
    "function_call": lambda v: v is None or v == "none",
    "response_format": lambda v: v is None or v == {"type": "text"},
    "modalities": lambda v: v is None or v == ["text"],
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "service_tier": lambda v: v is None or v in ("auto", "default"),
    "metadata": _is_empty,
    "reasoning_effort": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "verbosity": lambda v: v is None,
    "store": lambda v: v is None,
    "prompt_cache_key": lambda v: v is None,
    "safety_identifier": lambda v: v is None,
    "user": lambda v: True,  # recorded in logs, never trusted (the owner comes from the key)
}
_WHY = {
    "n": "one choice per request (n=1)",
    "functions": "the deprecated functions API; send tools and tool_choice",
    "function_call": "the deprecated functions API; send tools and tool_choice",
    "store": "every chat-completions conversation is stored (30 days, deletable through /conversations); the "
             "Responses API takes store=false",
    "response_format": "text replies only",
}


def _refuse_unsupported(body: Mapping[str, Any], handled: frozenset[str], no_op: Mapping[str, Callable[[Any], bool]],
                        why: Mapping[str, str]) -> None:
    for name, value in body.items():
        if name in handled:
            continue
        check = no_op.get(name)
        if check is None:
            raise invalid(name, "unknown parameter", "unknown_parameter")
        if not check(value):
            raise unsupported(name, why.get(name, ""))


def _text_of(content: Any, param: str, part_types: tuple[str, ...]) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _type_error(param, "a string or a list of text parts")
    texts: list[str] = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _type_error(where, "a content part object")
        kind = part.get("type")
        if kind not in part_types:
            raise unsupported(f"{where}.type", f"{kind!r} parts (chatmesh serves a text-only model)")
        text = part.get("text")
        if not isinstance(text, str):
            raise _type_error(f"{where}.text", "a string")
        texts.append(text)
    return "".join(texts)


ITEM_KEYS = frozenset({"role", "content", "type", "id", "status", "phase"})
ITEM_PARTS = ("input_text", "output_text", "text")
CHAT_KEYS = frozenset({"role", "content", "type", "tool_calls", "tool_call_id", "name", "refusal", "annotations",
                       "audio"})
# What an assistant message the API answered carries back when a client appends it as it came: kept only empty
_ECHOED = {"refusal": lambda v: v in (None, ""), "annotations": lambda v: isinstance(v, list) and not v,
           "audio": lambda v: v is None}
_CALL_ITEM_KEYS = frozenset({"type", "id", "call_id", "name", "arguments", "status"})
_OUTPUT_ITEM_KEYS = frozenset({"type", "id", "call_id", "output", "status"})


def _item(item: dict[str, Any], where: str, items: bool) -> Message | None:
    """A Responses function_call / function_call_output item as a message (None: not such an item)."""
    kind = item.get("type", "message")
    if not items or kind == "message":
        return None
    if kind not in ("function_call", "function_call_output"):
        raise unsupported(f"{where}.type", f"{str(kind)[:40]!r} items (messages, function_call and "
                                           "function_call_output only)")
    keys = _CALL_ITEM_KEYS if kind == "function_call" else _OUTPUT_ITEM_KEYS
    for key in item:
        if key not in keys:
            raise invalid(f"{where}.{key}", "unknown field", "unknown_parameter")
    if kind == "function_call":
        return Message(Role.ASSISTANT, "", tool_calls=(item_call(item, where),))
    call_id, output = item_output(item, where)
    return Message(Role.TOOL, output, tool_call_id=call_id)


def _messages(raw: Any, param: str, max_chars: int, part_types: tuple[str, ...], item_keys: frozenset[str],
              last_user: bool = True, start: int = 0, items: bool = False) -> tuple[Message, ...]:
    """`raw`'s messages; `start`: the index of raw[0] in the request's list (for the names in errors); `items`:
    Responses input, where function_call / function_call_output items are tool calls and results."""
    if not isinstance(raw, list):
        raise _type_error(param, "an array of messages")
    if not raw:
        raise invalid(param, "must not be empty")
    if len(raw) > MAX_MESSAGES:
        raise invalid(param, f"more than {MAX_MESSAGES} messages")
    out: list[Message] = []
    for i, item in enumerate(raw, start):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise _type_error(where, "a message object")
        tool_item = _item(item, where, items)
        if tool_item is not None:
            if len(tool_item.text) > max_chars:
                raise invalid(f"{where}.output", f"longer than {max_chars} characters", "string_above_max_length")
            # consecutive function_call items (and the message before them) are one assistant reply
            if tool_item.tool_calls and out and out[-1].role is Role.ASSISTANT:
                out[-1] = replace(out[-1], tool_calls=out[-1].tool_calls + tool_item.tool_calls)
            else:
                out.append(tool_item)
            continue
        for key in item:
            if key not in item_keys:
                if key in ("function_call", "audio", "refusal"):
                    raise unsupported(f"{where}.{key}", "text and tool calls only")
                raise invalid(f"{where}.{key}", "unknown field", "unknown_parameter")
            if key in _ECHOED and not _ECHOED[key](item[key]):
                raise unsupported(f"{where}.{key}", "text and tool calls only")
        if item.get("type", "message") != "message":
            raise unsupported(f"{where}.type", f"{item.get('type')!r} items (messages only)")
        role = item.get("role")
        roles = "system, developer, user, assistant" + (" or tool" if "tool_call_id" in item_keys else "")
        if not isinstance(role, str):
            raise invalid(f"{where}.role", f"is required ({roles})")
        if role not in _ROLES or (role == "tool" and "tool_call_id" not in item_keys):
            raise invalid(f"{where}.role", f"unknown role {role[:20]!r} ({roles})")
        calls: tuple[ToolCall, ...] = ()
        if "tool_calls" in item and item["tool_calls"] is not None:
            if role != "assistant":
                raise invalid(f"{where}.tool_calls", "only an assistant message makes tool calls")
            calls = message_calls(item["tool_calls"], where)
        call_id = ""
        if role == "tool":
            call_id = item.get("tool_call_id") or ""
            if not isinstance(call_id, str) or not call_id:
                raise invalid(f"{where}.tool_call_id", "a tool message names the call it answers",
                              "missing_required_parameter")
        elif "tool_call_id" in item:
            raise invalid(f"{where}.tool_call_id", "only a tool message answers a call")
        content = item.get("content")
        text = "" if content is None and role == "assistant" else _text_of(content, f"{where}.content", part_types)
        phase = item.get("phase")
        if phase is not None and (role != "assistant" or phase not in PHASES):
            raise invalid(f"{where}.phase", "only an assistant message has a phase: commentary or final_answer")
        if not text.strip() and role not in ("assistant", "tool"):  # a reply may be empty (blocked, a call)
            raise invalid(f"{where}.content", "must not be empty")
        if len(text) > max_chars:
            raise invalid(f"{where}.content", f"longer than {max_chars} characters", "string_above_max_length")
        out.append(Message(_ROLES[role], text, Phase(phase) if phase is not None else None, calls, call_id))
    _check_calls(out, param, leading_results=items)
    if last_user and out[-1].role not in (Role.USER, Role.TOOL):
        raise invalid(f"{param}[{start + len(out) - 1}].role",
                      "the last message must be the user's (the one to answer), or tool results answering the "
                      "last reply's calls")
    return tuple(out)


def _check_calls(messages: list[Message], param: str, leading_results: bool) -> None:
    """Each run of tool results follows an assistant message with calls and answers only those. With
    `leading_results` (Responses input, continuing a stored response), results that open the input answer calls
    the stored conversation holds (not checked here: the edge does not read the conversation for it)."""
    open_calls: set[str] = set()
    for i, m in enumerate(messages):
        if m.role is Role.TOOL:
            if leading_results and all(p.role is Role.TOOL for p in messages[:i]):
                continue
            if m.tool_call_id not in open_calls:
                raise invalid(f"{param}[{i}].tool_call_id", "answers no call of the assistant message before it")
            continue
        open_calls = {c.id for c in m.tool_calls}


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _type_error("stop", "a string or an array of strings")
    if len(stops) > MAX_STOP:
        raise invalid("stop", f"at most {MAX_STOP} stop sequences")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise invalid("stop", f"each stop sequence must be 1-{MAX_STOP_CHARS} characters")
    return tuple(stops)


def _max_tokens(body: Mapping[str, Any], names: tuple[str, ...], cap: int) -> int | None:
    values = {name: _integer(body, name, 1, 1 << 30) for name in names}
    given = {v for v in values.values() if v is not None}
    if len(given) > 1:
        raise invalid(names[0], f"{' and '.join(names)} disagree; send one")
    value = given.pop() if given else None
    if value is not None and value > cap:
        raise invalid(next(n for n, v in values.items() if v is not None),
                      f"must be at most {cap} (the model's context length)")
    return value


def model_of(body: Mapping[str, Any]) -> str:
    model = _string(body, "model", required=True, max_chars=256)
    assert model is not None
    return model


_CHAT_KEYS = frozenset({"model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
                        "temperature", "top_p", "seed", "stop", "user", "tools", "tool_choice", "parallel_tool_calls"})


def chat_request(body: Mapping[str, Any], *, max_chars: int, context_tokens: int) -> ChatRequest:
    reject_legacy_functions(body)
    _refuse_unsupported(body, _CHAT_KEYS, _NO_OP, _WHY)
    model = model_of(body)
    messages = _messages(body.get("messages"), "messages", max_chars, ("text",), CHAT_KEYS)
    tools = chat_tools(body)
    stream = _bool(body, "stream", False)
    include_usage = False
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise _type_error("stream_options", "an object")
        if not stream:
            raise invalid("stream_options", "only allowed with stream: true")
        for key in stream_options:
            if key not in ("include_usage", "include_obfuscation"):
                raise invalid(f"stream_options.{key}", "unknown field", "unknown_parameter")
        include_usage = _bool(stream_options, "include_usage", False)
        if _bool(stream_options, "include_obfuscation", False):
            raise unsupported("stream_options.include_obfuscation")
    options = Options(temperature=_number(body, "temperature", 0.0, 2.0), top_p=_number(body, "top_p", 0.0, 1.0),
                      seed=_integer(body, "seed", -(1 << 63), (1 << 64) - 1), stop=_stop(body),
                      max_tokens=_max_tokens(body, ("max_completion_tokens", "max_tokens"), context_tokens),
                      tools=tools)
    if options.top_p == 0.0:
        raise invalid("top_p", "must be above 0")
    if options.seed is not None and options.seed < 0:
        options = replace(options, seed=options.seed % (1 << 64))
    return ChatRequest(model, messages, stream, include_usage, options, _string(body, "user", max_chars=256))


_RESPONSE_KEYS = frozenset({"model", "input", "instructions", "previous_response_id", "conversation", "store",
                            "stream", "max_output_tokens", "temperature", "top_p", "user", "text", "truncation",
                            "stream_options", "background", "metadata", "safety_identifier", "prompt_cache_key",
                            "context_management", "tools", "tool_choice", "parallel_tool_calls", "max_tool_calls"})
_RESPONSE_NO_OP: dict[str, Callable[[Any], bool]] = {
    **{k: v for k, v in _NO_OP.items() if k in ("top_logprobs", "service_tier", "presence_penalty",
                                                 "frequency_penalty")},
    "include": _is_empty,
    "reasoning": lambda v: v is None or v == {} or v == {"effort": None, "summary": None},
    "prompt": lambda v: v is None,
}
MAX_METADATA = 16


def _metadata(body: Mapping[str, Any]) -> dict[str, str]:
    """Open Responses' metadata: at most 16 pairs, keys of at most 64 characters, string values of at most 512."""
    value = body.get("metadata")
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _type_error("metadata", "an object of string values")
    if len(value) > MAX_METADATA:
        raise invalid("metadata", f"at most {MAX_METADATA} pairs")
    for k, v in value.items():
        if len(k) > 64 or len(v) > 512:
            raise invalid(f"metadata.{k[:64]}", "keys are at most 64 characters, values at most 512")
    return dict(value)


COMPACTION_KEYS = frozenset({"type", "id", "encrypted_content", "created_by", "summary"})


def _compaction(raw: Any) -> tuple[str | None, int]:
    """An input's compaction item (`POST /responses/compact`'s output, sent back): its encrypted_content, and the
    index of the first item after it. The items before it are what it summarised: they are not sent again."""
    if not isinstance(raw, list):
        raise _type_error("input", "a string or an array of input items")
    at = [i for i, item in enumerate(raw) if isinstance(item, dict) and item.get("type") == "compaction"]
    if not at:
        return None, 0
    if len(at) > 1:
        raise invalid(f"input[{at[1]}]", "at most one compaction item (the last compaction covers the earlier ones)")
    item = raw[at[0]]
    for key in item:
        if key not in COMPACTION_KEYS:
            raise invalid(f"input[{at[0]}].{key}", "unknown field", "unknown_parameter")
    content = _string(item, "encrypted_content", required=True, max_chars=4096,
                      param=f"input[{at[0]}].encrypted_content")
    assert content is not None
    return content, at[0] + 1


def _compact_threshold(body: Mapping[str, Any]) -> int | None:
    """`context_management: [{"type": "compaction", "compact_threshold": N}]`: chatmesh summarises older turns once
    the history passes N tokens (as it does past CHATMESH_SUMMARY_THRESHOLD_TOKENS)."""
    value = body.get("context_management")
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > 1:
        raise _type_error("context_management", "an array of at most one {\"type\": \"compaction\"} entry")
    if not value:
        return None
    entry = value[0]
    if not isinstance(entry, dict) or entry.get("type") != "compaction" or set(entry) - {"type", "compact_threshold"}:
        raise unsupported("context_management[0]", "only {\"type\": \"compaction\", \"compact_threshold\": N}")
    return _integer(entry, "compact_threshold", 1, 1 << 30)


def response_request(body: Mapping[str, Any], *, max_chars: int, context_tokens: int) -> ResponseRequest:
    _refuse_unsupported(body, _RESPONSE_KEYS, _RESPONSE_NO_OP, {"background": "responses run in the foreground"})
    model = model_of(body)
    raw = body.get("input")
    if raw is None:
        raise invalid("input", "is required", "missing_required_parameter")
    if isinstance(raw, str):
        if not raw.strip():
            raise invalid("input", "must not be empty")
        if len(raw) > max_chars:
            raise invalid("input", f"longer than {max_chars} characters", "string_above_max_length")
        items: tuple[Message, ...] = (Message(Role.USER, raw),)
        compacted = None
    else:
        compacted, first = _compaction(raw)
        items = _messages(raw[first:], "input", max_chars, ITEM_PARTS, ITEM_KEYS, start=first, items=True)
    previous = _string(body, "previous_response_id", max_chars=128)
    if compacted is not None and previous is not None:
        raise invalid("previous_response_id", "cannot be used together with a compaction item in input (the "
                                              "compaction already names where the conversation stands)")
    conversation = body.get("conversation")
    if isinstance(conversation, dict):
        conversation = _string(conversation, "id", required=True, max_chars=128, param="conversation.id")
    elif conversation is not None and not isinstance(conversation, str):
        raise _type_error("conversation", "a conversation id or {\"id\": ...}")
    if previous is not None and conversation is not None:
        raise invalid("previous_response_id", "cannot be used together with conversation")
    text = body.get("text")
    if text is not None and text != {"format": {"type": "text"}} and text != {}:
        if not (isinstance(text, dict) and set(text) <= {"format", "verbosity"}
                and text.get("format", {"type": "text"}) == {"type": "text"} and text.get("verbosity") is None):
            raise unsupported("text", "plain text output only")
    truncation = body.get("truncation") or "disabled"
    if truncation not in ("auto", "disabled"):
        raise invalid("truncation", "must be auto or disabled")
    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None and not (isinstance(stream_options, dict)
                                           and set(stream_options) <= {"include_obfuscation"}):
        raise invalid("stream_options", "only include_obfuscation is known")
    options = Options(temperature=_number(body, "temperature", 0.0, 2.0), top_p=_number(body, "top_p", 0.0, 1.0),
                      max_tokens=_max_tokens(body, ("max_output_tokens",), context_tokens))
    if options.top_p == 0.0:
        raise invalid("top_p", "must be above 0")
    instructions = _string(body, "instructions", max_chars=max_chars) or ""
    store, background = _bool(body, "store", True), _bool(body, "background", False)
    if background and not store:
        raise invalid("background", "a background response is stored (store: true): it is read back later")
    return ResponseRequest(model, items, instructions, previous, conversation, store, stream, options,
                           _string(body, "user", max_chars=256), raw, compacted=compacted,
                           compact_threshold=_compact_threshold(body), background=background, truncation=truncation,
                           metadata=_metadata(body), safety_identifier=_string(body, "safety_identifier", max_chars=64),
                           prompt_cache_key=_string(body, "prompt_cache_key", max_chars=64), tools=response_tools(body))


def conversation_items(raw: Any, max_chars: int) -> tuple[Message, ...]:
    """POST /conversations `items`: messages to start a conversation with (any role last)."""
    return _messages(raw, "items", max_chars, ITEM_PARTS, ITEM_KEYS, last_user=False, items=True)


@dataclass(frozen=True)
class CompactRequest:
    """POST /responses/compact: what to compact, named by exactly one of the three."""

    model: str
    previous_response_id: str | None
    compacted: str | None  # the input is an earlier compaction's output: compact that point again
    items: tuple[Message, ...]  # a history of the client's own to compact (ends with a reply)


_COMPACT_KEYS = frozenset({"model", "input", "previous_response_id", "instructions", "prompt_cache_key"})


def compact_request(body: Mapping[str, Any], *, max_chars: int) -> CompactRequest:
    _refuse_unsupported(body, _COMPACT_KEYS, {}, {})
    model = model_of(body)
    if body.get("instructions"):
        raise unsupported("instructions", "chatmesh's summaries are written with its own summary prompt, the one "
                                          "every long conversation is summarised with")
    _string(body, "prompt_cache_key", max_chars=64)  # accepted; the cache is per owner and conversation already
    previous = _string(body, "previous_response_id", max_chars=128)
    raw = body.get("input")
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if raw is None or raw == []:
        if previous is None:
            raise invalid("input", "is required without previous_response_id", "missing_required_parameter")
        return CompactRequest(model, previous, None, ())
    if previous is not None:
        raise unsupported("input", "compacts either previous_response_id (a stored conversation) or input, "
                                   "not both")
    compacted, first = _compaction(raw)
    if compacted is not None:
        if first < len(raw):
            raise unsupported(f"input[{first}]", "nothing may follow a compaction item here: continue the "
                                                 "conversation with POST /responses first, then compact it")
        return CompactRequest(model, None, compacted, ())
    items = _messages(raw, "input", max_chars, ITEM_PARTS, ITEM_KEYS, last_user=False, items=True)
    if items[-1].role is not Role.ASSISTANT:
        raise invalid(f"input[{len(items) - 1}]", "a history to compact ends with the assistant's reply (chatmesh "
                                                  "summarises whole turns)")
    return CompactRequest(model, None, None, items)
