"""What the store accepts: the size limits of the fields it stores, and the checks that refuse a request past
them with INVALID_ARGUMENT naming the field (before anything is written)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from chatmesh.mesh.errors import InvalidArgument
from chatmesh.store.values import Role, ToolCall, ToolResult

MAX_LEASE_TTL_MS = 86_400_000
OPTIONS_OVERHEAD_BYTES = 64 * 1024  # a turn's options past its instructions (sampling, stops, tools)


@dataclass(frozen=True)
class FieldLimits:
    max_content_bytes: int = 1024 * 1024  # the message size policy's CHATMESH_MAX_MESSAGE_BYTES
    lease_ttl_ms: int = 30_000
    retention_days: int = 30
    max_title_chars: int = 200
    max_system_prompt_version_chars: int = 64
    max_fingerprint_chars: int = 128
    max_lease_holder_chars: int = 128

    def check_text(self, field: str, text: str, *, required: bool) -> None:
        if required and not text:
            raise InvalidArgument(f"{field} must not be empty")
        size = len(text.encode())
        if size > self.max_content_bytes:
            raise InvalidArgument(f"{field} is {size} bytes, over the limit of {self.max_content_bytes} "
                                  f"bytes (CHATMESH_MAX_MESSAGE_BYTES)")

    def check_options(self, options: str) -> None:
        """A turn's generation options: its instructions may be as long as a message, the rest is small."""
        size, limit = len(options.encode()), self.max_content_bytes + OPTIONS_OVERHEAD_BYTES
        if size > limit:
            raise InvalidArgument(f"generation_options is {size} bytes, over the limit of {limit} bytes "
                                  "(CHATMESH_MAX_MESSAGE_BYTES plus 64 KiB)")

    def check_tools(self, field: str, role: Role, calls: Sequence[ToolCall], results: Sequence[ToolResult]) -> None:
        """Tool calls only on an assistant message, results only (and always) on a tool message, within the
        message size limit."""
        if calls and role is not Role.ASSISTANT:
            raise InvalidArgument(f"{field}.tool_calls: only an assistant message has tool calls")
        if (role is Role.TOOL) != bool(results):
            raise InvalidArgument(f"{field}.tool_results: a tool message, and only one, carries tool results")
        for i, c in enumerate(calls):
            if not c.id or not c.name:
                raise InvalidArgument(f"{field}.tool_calls[{i}]: id and name are required")
        self.check_text(f"{field}.tool_calls", "".join(c.arguments + c.name + c.id for c in calls), required=False)
        self.check_text(f"{field}.tool_results", "".join(r.content + r.tool_call_id for r in results),
                        required=False)

    def ttl(self, lease_ttl_ms: int) -> int:
        """The lease a request asks for (0: the default), checked."""
        if not 0 <= lease_ttl_ms <= MAX_LEASE_TTL_MS:
            raise InvalidArgument(f"lease_ttl_ms must be 0 (the default) to {MAX_LEASE_TTL_MS}, got {lease_ttl_ms}")
        return lease_ttl_ms or self.lease_ttl_ms


def check_len(field: str, text: str, limit: int) -> None:
    if len(text) > limit:
        raise InvalidArgument(f"{field} is {len(text)} characters, over the limit of {limit}")


def check_count(field: str, value: int) -> None:
    if value < 0:
        raise InvalidArgument(f"{field} must not be negative, got {value}")
