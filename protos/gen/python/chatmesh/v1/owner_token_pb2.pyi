from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class IssueOwnerTokenRequest(_message.Message):
    __slots__ = ("owner_id", "conversation_id", "ttl_s", "scopes")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    SCOPES_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    conversation_id: str
    ttl_s: int
    scopes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, owner_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., ttl_s: _Optional[int] = ..., scopes: _Optional[_Iterable[str]] = ...) -> None: ...

class IssueOwnerTokenResponse(_message.Message):
    __slots__ = ("token", "expires_at_ms", "metadata_key", "key_id", "scopes", "prompt_token_allowance")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    METADATA_KEY_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    SCOPES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_ALLOWANCE_FIELD_NUMBER: _ClassVar[int]
    token: str
    expires_at_ms: int
    metadata_key: str
    key_id: str
    scopes: _containers.RepeatedScalarFieldContainer[str]
    prompt_token_allowance: int
    def __init__(self, token: _Optional[str] = ..., expires_at_ms: _Optional[int] = ..., metadata_key: _Optional[str] = ..., key_id: _Optional[str] = ..., scopes: _Optional[_Iterable[str]] = ..., prompt_token_allowance: _Optional[int] = ...) -> None: ...
