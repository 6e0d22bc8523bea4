"""Typed core errors shared by every service.

Cores raise these; each service's servicer maps them to gRPC status codes in exactly one place
(`chatmesh.mesh.server.status_for`), and the edge maps gRPC codes to HTTP. A core never raises a bare
`Exception` for a condition a caller can act on.
"""

from __future__ import annotations


PROMPT_TOKENS_TRAILER = "chatmesh-prompt-tokens"  # gRPC trailing metadata of a PromptOverAllowance


class CoreError(Exception):
    """Base of every error a core raises on purpose. The message is safe to show a caller."""

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """What the status carries besides its message (gRPC trailing metadata): ids and counts only."""
        return ()


class InvalidArgument(CoreError):
    """The request is malformed: a missing or invalid field, content over a limit."""


class NotFound(CoreError):
    """The thing does not exist for this owner (another owner's data is also NotFound, never a hint)."""


class Conflict(CoreError):
    """The request collides with stored state, such as a turn id reused for other content."""


class FailedPrecondition(CoreError):
    """The request is valid but the state does not allow it now, such as finishing a turn with a lost lease."""


class ResourceExhausted(CoreError):
    """A bounded queue or limit is full; retry later."""


class PromptOverAllowance(ResourceExhausted):
    """A turn's rendered prompt needs more tokens than its allowance (chat.proto's prompt_token_allowance, or the
    internal client's per-turn budget): refused before any engine work, the prompt's size in the trailer."""

    def __init__(self, prompt_tokens: int, allowance: int) -> None:
        super().__init__(f"the prompt is {prompt_tokens} tokens; the turn's allowance is {allowance}")
        self.prompt_tokens = prompt_tokens
        self.allowance = allowance

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((PROMPT_TOKENS_TRAILER, str(self.prompt_tokens)),)


class Unavailable(CoreError):
    """A dependency is down or no replica can serve; retry may succeed."""


class Unauthenticated(CoreError):
    """The call lacks a valid credential it needs (an owner-scoped call without a valid owner token)."""


class PermissionDenied(CoreError):
    """The caller is known but may not do this: its identity may not call the RPC, or its owner token is for
    another owner or conversation."""


# The trailer an engine's FAILED_PRECONDITION carries when it refuses to continue a reply it cannot continue
# exactly (generate.proto, GenerateRequest.resumed_tokens): chat fails the turn retryable instead of splicing it.
RESUME_REFUSED_TRAILER = "chatmesh-resume-refused"
