"""What the turn core needs from the other services, as protocols. `clients.py` implements them over gRPC and
turns gRPC failures into typed core errors; the core itself holds no channel or stub."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Protocol

from chatmesh.mesh.ids import ConversationId
from chatmesh.v1 import generate_pb2, route_pb2, store_pb2


class StorePort(Protocol):
    async def insert_conversation(self, req: store_pb2.InsertConversationRequest
                                  ) -> store_pb2.InsertConversationResponse: ...

    async def read_conversation(self, req: store_pb2.ReadConversationRequest) -> store_pb2.ReadConversationResponse: ...

    async def begin_turn(self, req: store_pb2.BeginTurnRequest) -> store_pb2.BeginTurnResponse: ...

    async def finish_turn(self, req: store_pb2.FinishTurnRequest) -> store_pb2.FinishTurnResponse: ...

    async def fail_turn(self, req: store_pb2.FailTurnRequest) -> store_pb2.FailTurnResponse: ...

    async def update_turn_progress(self, req: store_pb2.UpdateTurnProgressRequest
                                   ) -> store_pb2.UpdateTurnProgressResponse: ...

    async def read_turn(self, req: store_pb2.ReadTurnRequest) -> store_pb2.ReadTurnResponse: ...

    async def save_summary(self, req: store_pb2.SaveSummaryRequest) -> store_pb2.SaveSummaryResponse: ...

    async def list_conversations(self, req: store_pb2.ListOwnerConversationsRequest
                                 ) -> store_pb2.ListOwnerConversationsResponse: ...

    async def delete_conversation(self, req: store_pb2.DeleteStoredConversationRequest
                                  ) -> store_pb2.DeleteStoredConversationResponse: ...

    async def export(self, req: store_pb2.ExportOwnerDataRequest) -> store_pb2.ExportOwnerDataResponse: ...

    async def usage(self, req: store_pb2.ReadUsageRequest) -> store_pb2.ReadUsageResponse: ...


class RouterPort(Protocol):
    async def pick(self, conversation_id: ConversationId, exclude: Sequence[str] = ()
                   ) -> route_pb2.PickReplicaResponse: ...

    async def release(self, lease_id: str) -> None: ...

    async def replicas(self) -> list[route_pb2.ReplicaStatus]: ...


class EnginePort(Protocol):
    def generate(self, address: str, req: generate_pb2.GenerateRequest, timeout_s: float
                 ) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
        """Streams a generation; closing the iterator cancels the engine sequence."""
        ...

    async def evict(self, address: str, req: generate_pb2.EvictRequest) -> int: ...


@dataclass(frozen=True)
class Screening:
    """A moderation outcome as the turn sees it."""

    blocked: bool
    category: str  # the deciding category when blocked or flagged, else ""
    reason: str  # why, for the turn's outcome and logs (never the text)


class OutputScreen(Protocol):
    async def check(self, chunk: str, final: bool = False) -> Screening: ...

    async def close(self) -> None: ...


class ModerationPort(Protocol):
    async def check_input(self, text: str, conversation_id: ConversationId) -> Screening: ...

    async def open_output(self, conversation_id: ConversationId) -> OutputScreen: ...


class PeerPort(Protocol):
    """Other chat processes: a stop reaching the wrong process is forwarded to the one generating the turn."""

    async def stop(self, address: str, owner: str, conversation_id: str, turn_id: str) -> bool: ...
