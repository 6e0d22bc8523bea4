"""Every RPC of every service against every mesh identity, over real gRPC and real TLS: the identities the
issue names reach the RPC (they then succeed or fail for another reason), every other identity is answered
PERMISSION_DENIED naming itself and the RPC. The expected table is written out here, from the issue, so a
change to a service's rules shows up as a failing row, not a silently different policy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from chatmesh.chat import service as chat_service
from chatmesh.engine_adapter import service as engine_service
from chatmesh.gateway import owner_tokens
from chatmesh.mesh import authz, pki
from chatmesh.mesh import identity as ident
from chatmesh.mesh.config import Config
from chatmesh.mesh.identity import Identity
from chatmesh.mesh.server import Running, Service, start_server
from chatmesh.moderation import service as moderation_service
from chatmesh.router import service as router_service
from chatmesh.store import service as store_service
from tests.trust import channel_as, issuer_of, make_certs, trust_as

CHAT, ROUTER, OPERATOR, GATEWAY = ident.CHAT, ident.ROUTER, ident.OPERATOR, ident.GATEWAY
CLIENT = ident.client("dev")
EXPECTED: dict[str, dict[str, set[Identity]]] = {
    "chatmesh.v1.ChatService": {**{rpc: {GATEWAY, CLIENT} for rpc in (
        "CreateConversation", "GetConversation", "SendTurn", "AttachTurn", "RegenerateTurn", "ListConversations",
        "DeleteConversation", "GetUsage", "ExportUserData", "GetTurn", "DeleteTurn", "CompactConversation")},
        "StopTurn": {GATEWAY, CLIENT, CHAT}},
    "chatmesh.v1.StoreService": {**{rpc: {CHAT} for rpc in (
        "InsertConversation", "ReadConversation", "BeginTurn", "FinishTurn", "FailTurn", "UpdateTurnProgress",
        "ReadTurn", "SaveSummary", "ListOwnerConversations", "DeleteStoredConversation", "DeleteStoredTurn",
        "DeleteOwnerData",
        "ExportOwnerData", "ReadUsage")}, "PurgeExpired": {OPERATOR}},
    "chatmesh.v1.GenerateService": {"Generate": {CHAT}, "Evict": {CHAT}, "GetStats": {ROUTER, CHAT, OPERATOR},
                                    "WatchStats": {ROUTER, CHAT, OPERATOR}, "PullPrefix": {ident.ENGINE},
                                    "CancelTurn": {CHAT}},
    "chatmesh.v1.RouteService": {"PickReplica": {CHAT}, "ReleaseLease": {CHAT}, "ListReplicas": {CHAT, OPERATOR}},
    "chatmesh.v1.ModerateService": {"CheckInput": {CHAT}, "CheckOutput": {CHAT}, "CheckOutputBatch": {CHAT}},
    "chatmesh.v1.OwnerTokenService": {"IssueOwnerToken": {CLIENT}},
}
SERVER_NAME = {"chatmesh.v1.ChatService": "chat", "chatmesh.v1.StoreService": "store",
               "chatmesh.v1.GenerateService": "engine", "chatmesh.v1.RouteService": "router",
               "chatmesh.v1.ModerateService": "moderation", "chatmesh.v1.OwnerTokenService": "gateway"}
CALLERS = pki.default_identities(["dev"])


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("authz") / "certs")


@pytest.fixture
async def servers(certs: Path, tmp_path: Path) -> AsyncIterator[dict[str, int]]:
    data = tmp_path
    cfg = Config(env={"CHATMESH_DATA_DIR": str(data), "CHATMESH_ENGINE": "sim", "CHATMESH_SIM_TEXT": "words",
                      "CHATMESH_STORE_PURGE_INTERVAL_S": "0", "CHATMESH_ROUTER_HEALTH": "false"})
    built: list[tuple[str, Service, Identity]] = [
        ("chatmesh.v1.ChatService", chat_service.build(cfg, trust_as(certs, CHAT)), CHAT),
        ("chatmesh.v1.StoreService", store_service.build(cfg, trust_as(certs, ident.STORE)), ident.STORE),
        ("chatmesh.v1.GenerateService", engine_service.build(cfg, trust_as(certs, ident.ENGINE)), ident.ENGINE),
        ("chatmesh.v1.RouteService", router_service.build(cfg, trust_as(certs, ROUTER)), ROUTER),
        ("chatmesh.v1.ModerateService", moderation_service.build(cfg), ident.MODERATION),
        ("chatmesh.v1.OwnerTokenService", owner_tokens.token_service(issuer_of(certs)), GATEWAY),
    ]
    running: list[tuple[Service, Running]] = []
    ports = {}
    for name, service, who in built:
        r = await start_server(service, "127.0.0.1:0", trust=trust_as(certs, who))
        running.append((service, r))
        ports[name] = r.port
    yield ports
    for service, r in running:
        await r.stop(service, 0)


async def outcome(channel: grpc.aio.Channel, path: str, kind: str) -> tuple[grpc.StatusCode, str]:
    """The status of one call with an empty request (a streaming answer: its first message, then cancel)."""
    try:
        match kind:
            case "unary_unary":
                await channel.unary_unary(path, None, None)(b"", timeout=10)
            case "unary_stream":
                streamed = channel.unary_stream(path, None, None)(b"", timeout=10)
                await streamed.read()
                streamed.cancel()
            case "stream_stream":
                both = channel.stream_stream(path, None, None)(iter(()), timeout=10)
                await both.read()
                both.cancel()
            case _:
                raise AssertionError(kind)
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def kind_of(service: str, rpc: str) -> str:
    from google.protobuf import descriptor_pool
    method = descriptor_pool.Default().FindMethodByName(f"{service}.{rpc}")  # type: ignore[no-untyped-call]
    return {(False, False): "unary_unary", (False, True): "unary_stream",
            (True, True): "stream_stream"}[(method.client_streaming, method.server_streaming)]


def test_the_tables_in_force_are_the_issues() -> None:
    for service, rules in EXPECTED.items():
        assert {p.rsplit("/", 1)[1] for p in authz.methods_of(service)} == set(rules), service


async def test_every_rpc_of_every_service_against_every_identity(certs: Path, servers: dict[str, int]) -> None:
    for service in EXPECTED:
        await _walk(certs, servers, service)


async def _walk(certs: Path, servers: dict[str, int], service: str) -> None:
    rows = []
    for who in CALLERS:
        async with channel_as(certs, who, f"127.0.0.1:{servers[service]}", SERVER_NAME[service]) as channel:
            results = await asyncio.gather(*(outcome(channel, f"/{service}/{rpc}", kind_of(service, rpc))
                                             for rpc in EXPECTED[service]))
        for rpc, (code, details) in zip(EXPECTED[service], results):
            allowed = who in EXPECTED[service][rpc]
            denied = code == grpc.StatusCode.PERMISSION_DENIED and \
                details == f"{who} may not call /{service}/{rpc}"
            rows.append((who, rpc, allowed, code.name))
            assert denied != allowed, (who, rpc, code, details)
    assert any(allowed for *_, allowed, _ in rows) and not all(allowed for *_, allowed, _ in rows)


async def test_every_service_port_refuses_a_peer_without_a_certificate_or_with_one_from_another_ca(
        certs: Path, servers: dict[str, int], tmp_path: Path) -> None:
    """Each real service's port (the gateway's OwnerTokenService too): no client certificate, a client certificate
    of another CA (the client itself trusting the mesh's CA, so the server is what refuses) and plaintext get no
    answer; the operator's certificate gets health."""
    other = make_certs(tmp_path / "other-ca")
    ca = (certs / pki.CA_FILE).read_bytes()
    stem = ident.file_stem(OPERATOR)
    foreign = grpc.ssl_channel_credentials(ca, (other / f"{stem}-key.pem").read_bytes(),
                                           (other / f"{stem}.pem").read_bytes())
    health = "/grpc.health.v1.Health/Check"
    for service, port in servers.items():
        address = f"127.0.0.1:{port}"
        name = [("grpc.ssl_target_name_override", ident.server_name(SERVER_NAME[service]))]
        for credentials in (grpc.ssl_channel_credentials(ca), foreign):
            async with grpc.aio.secure_channel(address, credentials, name) as refused:
                assert (await outcome(refused, health, "unary_unary"))[0] == grpc.StatusCode.UNAVAILABLE, service
        async with grpc.aio.insecure_channel(address) as plain:
            assert (await outcome(plain, health, "unary_unary"))[0] == grpc.StatusCode.UNAVAILABLE, service
        async with channel_as(certs, OPERATOR, address, SERVER_NAME[service]) as operator:
            assert (await outcome(operator, health, "unary_unary")) == (grpc.StatusCode.OK, ""), service
