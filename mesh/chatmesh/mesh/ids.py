"""Distinct id types, so the type checker refuses a turn id where a conversation id belongs.

Each id is a `NewType` over `str`; the `parse_*` functions are the only way in from the wire and raise
`InvalidId` (an `InvalidArgument` core error) naming the field when the text is not a valid id. An id is written
to logs as it is, so each is validated to a charset that cannot forge a log line or a field of one (issue 30:
an internal caller's owner id, spaces and `key=value` pairs included, went into a log line verbatim): UUIDs, and
owner ids of ASCII letters, digits and `._@:+-` (user ids are UUIDs; the development user, e-mail-like names and
front-ends' end users fit).
"""

from __future__ import annotations

import re
import uuid
from typing import NewType

from chatmesh.mesh.errors import InvalidArgument

OwnerId = NewType("OwnerId", str)
ConversationId = NewType("ConversationId", str)
TurnId = NewType("TurnId", str)
ReplicaId = NewType("ReplicaId", str)
LeaseId = NewType("LeaseId", str)

MAX_OWNER_ID_BYTES = 128
_OWNER_ID = re.compile(r"[A-Za-z0-9._@:+-]+")


class InvalidId(InvalidArgument):
    """A field that should hold an id does not."""


def _uuid(field: str, text: str) -> str:
    if not text:
        raise InvalidId(f"{field} is required (a UUID)")
    try:
        return str(uuid.UUID(text))
    except ValueError:
        raise InvalidId(f"{field} must be a UUID, got {text[:40]!r}") from None


def parse_conversation_id(text: str, field: str = "conversation_id") -> ConversationId:
    return ConversationId(_uuid(field, text))


def parse_turn_id(text: str, field: str = "turn_id") -> TurnId:
    return TurnId(_uuid(field, text))


def parse_lease_id(text: str, field: str = "lease_id") -> LeaseId:
    return LeaseId(_uuid(field, text))


def parse_owner_id(text: str, field: str = "owner_id") -> OwnerId:
    if not text:
        raise InvalidId(f"{field} is required")
    if len(text) > MAX_OWNER_ID_BYTES or not _OWNER_ID.fullmatch(text):
        raise InvalidId(f"{field} must be 1-{MAX_OWNER_ID_BYTES} ASCII letters, digits or ._@:+- characters")
    return OwnerId(text)


def new_conversation_id() -> ConversationId:
    return ConversationId(str(uuid.uuid4()))


def new_lease_id() -> LeaseId:
    return LeaseId(str(uuid.uuid4()))
