from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PickOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PICK_OUTCOME_UNSPECIFIED: _ClassVar[PickOutcome]
    PICK_OUTCOME_HOME: _ClassVar[PickOutcome]
    PICK_OUTCOME_SPILL: _ClassVar[PickOutcome]
    PICK_OUTCOME_PLACED: _ClassVar[PickOutcome]

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    REPLICA_STATE_SERVING: _ClassVar[ReplicaState]
    REPLICA_STATE_NOT_SERVING: _ClassVar[ReplicaState]
    REPLICA_STATE_DRAINING: _ClassVar[ReplicaState]
PICK_OUTCOME_UNSPECIFIED: PickOutcome
PICK_OUTCOME_HOME: PickOutcome
PICK_OUTCOME_SPILL: PickOutcome
PICK_OUTCOME_PLACED: PickOutcome
REPLICA_STATE_UNSPECIFIED: ReplicaState
REPLICA_STATE_SERVING: ReplicaState
REPLICA_STATE_NOT_SERVING: ReplicaState
REPLICA_STATE_DRAINING: ReplicaState

class PickReplicaRequest(_message.Message):
    __slots__ = ("conversation_id", "exclude_replica_ids")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    exclude_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, conversation_id: _Optional[str] = ..., exclude_replica_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PickReplicaResponse(_message.Message):
    __slots__ = ("replica_id", "address", "lease_id", "outcome", "home_replica_id", "lease_expires_at_ms", "source_replica_id", "source_address", "source_cached_tokens")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    HOME_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    lease_id: str
    outcome: PickOutcome
    home_replica_id: str
    lease_expires_at_ms: int
    source_replica_id: str
    source_address: str
    source_cached_tokens: int
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., lease_id: _Optional[str] = ..., outcome: _Optional[_Union[PickOutcome, str]] = ..., home_replica_id: _Optional[str] = ..., lease_expires_at_ms: _Optional[int] = ..., source_replica_id: _Optional[str] = ..., source_address: _Optional[str] = ..., source_cached_tokens: _Optional[int] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("replica_id", "address", "state", "engine_load", "open_leases", "load", "reason", "cached_conversations", "serves_pulls", "receives_pulls", "cached_tokens")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_LOAD_FIELD_NUMBER: _ClassVar[int]
    OPEN_LEASES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_CONVERSATIONS_FIELD_NUMBER: _ClassVar[int]
    SERVES_PULLS_FIELD_NUMBER: _ClassVar[int]
    RECEIVES_PULLS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    state: ReplicaState
    engine_load: int
    open_leases: int
    load: int
    reason: str
    cached_conversations: int
    serves_pulls: bool
    receives_pulls: bool
    cached_tokens: int
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[_Union[ReplicaState, str]] = ..., engine_load: _Optional[int] = ..., open_leases: _Optional[int] = ..., load: _Optional[int] = ..., reason: _Optional[str] = ..., cached_conversations: _Optional[int] = ..., serves_pulls: _Optional[bool] = ..., receives_pulls: _Optional[bool] = ..., cached_tokens: _Optional[int] = ...) -> None: ...
