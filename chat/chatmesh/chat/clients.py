"""gRPC implementations of the chat core's ports. Failures of downstream calls become typed core errors here, in
one place (`translate`), so the core and the ChatService servicer never see a raw gRPC error."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import TypeVar

import grpc

from chatmesh.chat.ports import OutputScreen, Screening
from chatmesh.mesh import errors
from chatmesh.mesh.ids import ConversationId
from chatmesh.moderation.client import ModerationClient, OutputSession, Outcome, categories_of
from chatmesh.v1 import (
    chat_pb2, chat_pb2_grpc, generate_pb2, generate_pb2_grpc, route_pb2, route_pb2_grpc, store_pb2, store_pb2_grpc,
)

T = TypeVar("T")

_BY_CODE: dict[grpc.StatusCode, type[errors.CoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: errors.Conflict,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
}


def translate(err: grpc.aio.AioRpcError, service: str) -> errors.CoreError:
    """A downstream gRPC failure as a core error; anything not the caller's fault is Unavailable."""
    kind = _BY_CODE.get(err.code(), errors.Unavailable)
    detail = err.details() or err.code().name
    if kind is errors.Unavailable:
        return errors.Unavailable(f"{service} unavailable ({err.code().name}): {detail}")
    return kind(detail)


async def call(service: str, awaitable: Awaitable[T]) -> T:
    try:
        return await awaitable
    except grpc.aio.AioRpcError as err:
        raise translate(err, service) from None


class Channels:
    """One channel per address, reused by every call (connection setup is the expensive part of a hop)."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address)
        return self._channels[address]

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close(None)
        self._channels.clear()


class GrpcStore:
    def __init__(self, channel: grpc.aio.Channel):
        self.stub = store_pb2_grpc.StoreServiceStub(channel)

    async def insert_conversation(self, req: store_pb2.InsertConversationRequest
                                  ) -> store_pb2.InsertConversationResponse:
        return await call("store", self.stub.InsertConversation(req))

    async def read_conversation(self, req: store_pb2.ReadConversationRequest) -> store_pb2.ReadConversationResponse:
        return await call("store", self.stub.ReadConversation(req))

    async def begin_turn(self, req: store_pb2.BeginTurnRequest) -> store_pb2.BeginTurnResponse:
        return await call("store", self.stub.BeginTurn(req))

    async def finish_turn(self, req: store_pb2.FinishTurnRequest) -> store_pb2.FinishTurnResponse:
        return await call("store", self.stub.FinishTurn(req))

    async def fail_turn(self, req: store_pb2.FailTurnRequest) -> store_pb2.FailTurnResponse:
        return await call("store", self.stub.FailTurn(req))

    async def update_turn_progress(self, req: store_pb2.UpdateTurnProgressRequest
                                   ) -> store_pb2.UpdateTurnProgressResponse:
        return await call("store", self.stub.UpdateTurnProgress(req))

    async def read_turn(self, req: store_pb2.ReadTurnRequest) -> store_pb2.ReadTurnResponse:
        return await call("store", self.stub.ReadTurn(req))

    async def save_summary(self, req: store_pb2.SaveSummaryRequest) -> store_pb2.SaveSummaryResponse:
        return await call("store", self.stub.SaveSummary(req))

    async def list_conversations(self, req: store_pb2.ListOwnerConversationsRequest
                                 ) -> store_pb2.ListOwnerConversationsResponse:
        return await call("store", self.stub.ListOwnerConversations(req))

    async def delete_conversation(self, req: store_pb2.DeleteStoredConversationRequest
                                  ) -> store_pb2.DeleteStoredConversationResponse:
        return await call("store", self.stub.DeleteStoredConversation(req))

    async def export(self, req: store_pb2.ExportOwnerDataRequest) -> store_pb2.ExportOwnerDataResponse:
        return await call("store", self.stub.ExportOwnerData(req))

    async def usage(self, req: store_pb2.ReadUsageRequest) -> store_pb2.ReadUsageResponse:
        return await call("store", self.stub.ReadUsage(req))


class GrpcRouter:
    def __init__(self, channel: grpc.aio.Channel):
        self.stub = route_pb2_grpc.RouteServiceStub(channel)

    async def pick(self, conversation_id: ConversationId, exclude: Sequence[str] = ()
                   ) -> route_pb2.PickReplicaResponse:
        return await call("router", self.stub.PickReplica(route_pb2.PickReplicaRequest(
            conversation_id=conversation_id, exclude_replica_ids=list(exclude))))

    async def release(self, lease_id: str) -> None:
        await call("router", self.stub.ReleaseLease(route_pb2.ReleaseLeaseRequest(lease_id=lease_id)))

    async def replicas(self) -> list[route_pb2.ReplicaStatus]:
        resp = await call("router", self.stub.ListReplicas(route_pb2.ListReplicasRequest()))
        return list(resp.replicas)


class GrpcEngines:
    def __init__(self, channels: Channels):
        self.channels = channels

    async def generate(self, address: str, req: generate_pb2.GenerateRequest, timeout_s: float
                       ) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
        stub = generate_pb2_grpc.GenerateServiceStub(self.channels.get(address))
        rpc = stub.Generate(req, timeout=timeout_s)
        try:
            async for resp in rpc:
                yield resp
        except grpc.aio.AioRpcError as err:
            raise translate(err, f"engine at {address}") from None
        finally:
            rpc.cancel()  # a no-op after a normal end; otherwise cancels the engine sequence

    async def evict(self, address: str, req: generate_pb2.EvictRequest) -> int:
        stub = generate_pb2_grpc.GenerateServiceStub(self.channels.get(address))
        resp = await call(f"engine at {address}", stub.Evict(req))
        return resp.blocks_evicted


def _screening(outcome: Outcome) -> Screening:
    """A moderation outcome as the turn records it; a failure-policy block names moderation, not a category."""
    if outcome.fallback:
        category = "moderation_unavailable"
    else:
        category = next(iter(categories_of(outcome)), "")
    return Screening(blocked=outcome.blocked, category=category, reason=outcome.reason)


class ModerationOutput:
    """One reply's output session: chunks in order, one outcome each, the window spanning chunks."""

    def __init__(self, session: OutputSession):
        self.session = session

    async def check(self, chunk: str, final: bool = False) -> Screening:
        return _screening(await self.session.check(chunk, final=final))

    async def close(self) -> None:
        await self.session.close()


class Moderation:
    """The moderation service through its client, which applies the configured failure policy per direction
    (fail closed or open) when the service is down, failing or slow, and says so in the outcome."""

    def __init__(self, client: ModerationClient):
        self.client = client

    async def check_input(self, text: str, conversation_id: ConversationId) -> Screening:
        return _screening(await self.client.check_input(text, conversation_id))

    async def open_output(self, conversation_id: ConversationId) -> OutputScreen:
        return ModerationOutput(self.client.output(conversation_id))

    async def close(self) -> None:
        await self.client.close()


class GrpcPeers:
    """Forwards a stop to the chat process that holds the turn's lease."""

    def __init__(self, channels: Channels):
        self.channels = channels

    async def stop(self, address: str, owner: str, conversation_id: str, turn_id: str) -> bool:
        stub = chat_pb2_grpc.ChatServiceStub(self.channels.get(address))
        resp = await call(f"chat process at {address}", stub.StopTurn(chat_pb2.StopTurnRequest(
            owner_id=owner, conversation_id=conversation_id, turn_id=turn_id), timeout=5))
        return resp.stopped
