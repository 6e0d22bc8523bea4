"""The tool wire of the OpenAI-compatible surface: tool definitions, tool_choice and parallel_tool_calls in both
APIs' shapes, tool calls and results in messages and items, and the JSON chatmesh answers with. Translation only:
what a tool call looks like to the model, and reading it back out of a reply, is the model profile's
(chatmesh.model.tools); the chat service stores calls and results as turns of their own.

Chat Completions: `tools: [{"type": "function", "function": {"name", "description", "parameters", "strict"}}]`,
`tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name"}}`, assistant messages with
`tool_calls: [{"id", "type": "function", "function": {"name", "arguments"}}]`, `tool` messages with `tool_call_id`;
a reply's calls come back in `message.tool_calls` (finish_reason "tool_calls") or, streamed, as one
`delta.tool_calls` chunk per call carrying its id, name and whole arguments.

Responses: `tools: [{"type": "function", "name", "description", "parameters", "strict"}]` (normalised to the
Chat Completions object, so the prompt is the same whichever API sent it), `tool_choice: ... | {"type":
"function", "name"}`, input items `function_call` {call_id, name, arguments} and `function_call_output`
{call_id, output}; a reply's calls are `function_call` output items, streamed as response.output_item.added,
response.function_call_arguments.delta (the whole arguments), .done, response.output_item.done.

Where chatmesh differs from OpenAI: only function tools (no built-in, custom or MCP tools: a 400 naming the
type); `strict` is kept in the definition the model sees but not enforced (no constrained decoding: a call whose
arguments are not a JSON object is returned as text); `tool_choice` required/named starts the reply with the
call's opening; arguments stream whole, once the call is complete; Llama 3.1 makes at most one call per reply.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chatmesh.gateway.openai.errors import invalid, unsupported
from chatmesh.model.tools import AUTO, ChoiceMode, ToolCall, ToolChoice, ToolDefinition

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
MAX_ID_CHARS = 128
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")


@dataclass(frozen=True)
class Tools:
    """A request's tools, as chat takes them, and as the Responses object echoes them."""

    definitions: tuple[ToolDefinition, ...] = ()
    choice: ToolChoice = AUTO
    parallel: bool | None = None  # None: unset (true)
    echo: tuple[Any, ...] = ()  # the Responses tool objects as sent
    echo_choice: Any = "auto"
    max_calls: int | None = None  # Responses' max_tool_calls: echoed (it limits built-in tools; chatmesh has none)

    def response_fields(self) -> dict[str, Any]:
        """The Response object's tool fields (OpenAI's defaults when none were sent)."""
        return {"tools": list(self.echo), "tool_choice": self.echo_choice,
                "parallel_tool_calls": True if self.parallel is None else self.parallel, "max_tool_calls": self.max_calls}


NO_TOOLS = Tools()


def _function(obj: Any, param: str) -> dict[str, Any]:
    """A function's definition checked: a valid name, an object of parameters (a JSON schema) if any."""
    if not isinstance(obj, dict):
        raise invalid(param, "expected a function object", "invalid_type")
    for key in obj:
        if key not in _FUNCTION_KEYS:
            raise invalid(f"{param}.{key}", "unknown field", "unknown_parameter")
    name = obj.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise invalid(f"{param}.name", "must be 1-64 letters, digits, underscores or dashes")
    if "description" in obj and not isinstance(obj["description"], str):
        raise invalid(f"{param}.description", "expected a string", "invalid_type")
    if "parameters" in obj and not isinstance(obj["parameters"], dict):
        raise invalid(f"{param}.parameters", "expected a JSON schema object", "invalid_type")
    if "strict" in obj and not isinstance(obj["strict"], (bool, type(None))):
        raise invalid(f"{param}.strict", "expected a boolean", "invalid_type")
    return obj


def _definitions(raw: Any, responses: bool) -> tuple[tuple[ToolDefinition, ...], tuple[Any, ...]]:
    if raw is None:
        return (), ()
    if not isinstance(raw, list):
        raise invalid("tools", "expected an array of tools", "invalid_type")
    if len(raw) > MAX_TOOLS:
        raise invalid("tools", f"at most {MAX_TOOLS} tools")
    out: list[ToolDefinition] = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(where, "expected a tool object", "invalid_type")
        kind = tool.get("type")
        if kind != "function":
            raise unsupported(f"{where}.type", f"{str(kind)[:40]!r} tools (function tools only)")
        if responses:
            body = _function({k: v for k, v in tool.items() if k != "type"}, where)
        else:
            extra = set(tool) - {"type", "function"}
            if extra:
                raise invalid(f"{where}.{sorted(extra)[0]}", "unknown field", "unknown_parameter")
            body = _function(tool.get("function"), f"{where}.function")
        out.append(ToolDefinition.of({"type": "function", "function": body}))
    if len({t.name for t in out}) != len(out):
        raise invalid("tools", "tool names must be unique")
    return tuple(out), tuple(raw)


def _choice(raw: Any, names: Sequence[str], responses: bool) -> ToolChoice:
    if raw is None or raw == "auto":
        return AUTO
    if raw in ("none", "required"):
        if raw == "required" and not names:
            raise invalid("tool_choice", "required needs tools")
        return ToolChoice(ChoiceMode(raw))
    if isinstance(raw, dict) and raw.get("type") == "function":
        name = raw.get("name") if responses else (raw.get("function") or {}).get("name")
        if not isinstance(name, str) or name not in names:
            raise invalid("tool_choice", "names a function that is not among the tools")
        return ToolChoice(ChoiceMode.NAMED, name)
    if isinstance(raw, dict) and raw.get("type") in ("allowed_tools", "custom", "mcp"):
        raise unsupported("tool_choice", f"{raw['type']} (none, auto, required or one function)")
    raise invalid("tool_choice", "expected none, auto, required or a function", "invalid_value")


def _parallel(body: Mapping[str, Any]) -> bool | None:
    value = body.get("parallel_tool_calls")
    if value is not None and not isinstance(value, bool):
        raise invalid("parallel_tool_calls", "expected a boolean", "invalid_type")
    return value


def chat_tools(body: Mapping[str, Any]) -> Tools:
    """Chat Completions' tools, tool_choice and parallel_tool_calls."""
    definitions, _ = _definitions(body.get("tools"), responses=False)
    choice = _choice(body.get("tool_choice"), [t.name for t in definitions], responses=False)
    return Tools(definitions, choice, _parallel(body))


def response_tools(body: Mapping[str, Any]) -> Tools:
    """The Responses API's tools, tool_choice and parallel_tool_calls (echoed in the Response object as sent)."""
    definitions, echo = _definitions(body.get("tools"), responses=True)
    raw_choice = body.get("tool_choice")
    choice = _choice(raw_choice, [t.name for t in definitions], responses=True)
    max_calls = body.get("max_tool_calls")
    if max_calls is not None and (isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1):
        raise invalid("max_tool_calls", "expected an integer of at least 1", "invalid_type")
    return Tools(definitions, choice, _parallel(body), echo, "auto" if raw_choice is None else raw_choice, max_calls)


# ---- calls and results in messages ---------------------------------------------------------------------------

def _id(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise invalid(param, f"expected a call id of 1-{MAX_ID_CHARS} characters")
    return value


def _arguments(value: Any, param: str) -> str:
    """A call's arguments: JSON object text (as the API carries it), checked to be one."""
    if not isinstance(value, str):
        raise invalid(param, "expected a string of JSON", "invalid_type")
    try:
        parsed = json.loads(value or "{}")
    except ValueError:
        raise invalid(param, "must be a JSON object") from None
    if not isinstance(parsed, dict):
        raise invalid(param, "must be a JSON object")
    return value or "{}"


def message_calls(raw: Any, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls` (Chat Completions)."""
    if not isinstance(raw, list) or not raw:
        raise invalid(f"{where}.tool_calls", "expected a non-empty array of tool calls", "invalid_type")
    out = []
    for j, call in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise unsupported(f"{at}.type", "function calls only")
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(f"{at}.function", "expected {name, arguments}")
        out.append(ToolCall(_id(call.get("id"), f"{at}.id"), function["name"],
                            _arguments(function.get("arguments", "{}"), f"{at}.function.arguments")))
    return tuple(out)


def item_call(item: Mapping[str, Any], where: str) -> ToolCall:
    """A Responses `function_call` input item."""
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.name", "is required", "missing_required_parameter")
    return ToolCall(_id(item.get("call_id"), f"{where}.call_id"), name,
                    _arguments(item.get("arguments", "{}"), f"{where}.arguments"))


def item_output(item: Mapping[str, Any], where: str) -> tuple[str, str]:
    """A Responses `function_call_output` input item: (call_id, output text)."""
    output = item.get("output")
    if isinstance(output, list):  # output content parts: their text
        output = "".join(p.get("text", "") for p in output if isinstance(p, dict))
    if not isinstance(output, str):
        raise invalid(f"{where}.output", "expected a string", "invalid_type")
    return _id(item.get("call_id"), f"{where}.call_id"), output


# ---- what chatmesh answers -----------------------------------------------------------------------------------

def completion_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """`message.tool_calls` of a chat completion."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def chunk_call(call: ToolCall, index: int) -> dict[str, Any]:
    """The `delta.tool_calls` entry of a streamed call: id, name and whole arguments in one chunk."""
    return {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def item_id(call: ToolCall) -> str:
    return "fc_" + call.id.removeprefix("call_")


def function_call_item(call: ToolCall, status: str) -> dict[str, Any]:
    """A Responses `function_call` output item."""
    return {"type": "function_call", "id": item_id(call), "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status != "in_progress" else "", "status": status}


def reject_legacy_functions(body: Mapping[str, Any]) -> None:
    """`functions` / `function_call`, the API's deprecated form of tools."""
    for name in ("functions", "function_call"):
        if body.get(name) not in (None, [], "none"):
            raise unsupported(name, "the deprecated functions API; send tools and tool_choice")

