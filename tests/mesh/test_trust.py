"""The mesh's trust layer over real gRPC and real TLS: refused connections (one test per outsider's class:
plaintext, no certificate, a foreign CA, expired or not yet valid, wrong or missing SPIFFE id), identity rules,
the health-only port, certificate rotation under an open stream (server and client side), plaintext refused off
loopback."""

from __future__ import annotations

import asyncio
import datetime
import io
import socket
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chatmesh.mesh import channels, pki
from chatmesh.mesh import identity as ident
from chatmesh.mesh.identity import Identity
from chatmesh.mesh.server import Running, Service, serve, start_server
from chatmesh.mesh.tls import TlsFiles
from chatmesh.mesh.trust import Trust, TrustRefused
from chatmesh.v1 import generate_pb2, generate_pb2_grpc, route_pb2, route_pb2_grpc
from tests.conftest import free_port
from tests.mesh.conftest import events


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pki") / "certs"
    pki.ensure(folder)
    return folder


def trust_of(folder: Path, who: Identity) -> Trust:
    return Trust.from_files(TlsFiles.in_folder(folder, who), who, folder / pki.TOKEN_PUBLIC_KEYS_FILE)


class Route(route_pb2_grpc.RouteServiceServicer):
    async def ListReplicas(self, request: route_pb2.ListReplicasRequest, context: Any
                           ) -> route_pb2.ListReplicasResponse:
        return route_pb2.ListReplicasResponse()


class SlowEngine(generate_pb2_grpc.GenerateServiceServicer):
    """Streams five deltas 150 ms apart; records the serial of each caller's client certificate."""

    def __init__(self) -> None:
        self.client_serials: list[int] = []

    async def Generate(self, request: generate_pb2.GenerateRequest, context: Any
                       ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        pem = context.auth_context()["x509_pem_cert"][0]
        self.client_serials.append(x509.load_pem_x509_certificate(pem).serial_number)
        for i in range(5):
            await asyncio.sleep(0.15)
            yield generate_pb2.GenerateResponse(delta=generate_pb2.GenerateDelta(token_ids=[i]))


ROUTE_RULES = {"chatmesh.v1.RouteService": {"PickReplica": [ident.CHAT], "ReleaseLease": [ident.CHAT],
                                            "ListReplicas": [ident.CHAT, ident.OPERATOR]}}


def route_service() -> Service:
    def register(server: grpc.aio.Server) -> list[str]:
        route_pb2_grpc.add_RouteServiceServicer_to_server(Route(), server)  # type: ignore[abstract]
        return ["chatmesh.v1.RouteService"]

    return Service("router", register, authz=ROUTE_RULES)


def engine_service(servicer: SlowEngine) -> Service:
    def register(server: grpc.aio.Server) -> list[str]:
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, server)
        return ["chatmesh.v1.GenerateService"]

    every = {n: [ident.CHAT] for n in ("Generate", "Evict", "GetStats", "WatchStats", "PullPrefix", "CancelTurn")}
    return Service("engine", register, authz={"chatmesh.v1.GenerateService": every})


@pytest.fixture
async def router(certs: Path) -> AsyncIterator[Running]:
    service = route_service()
    running = await start_server(service, "127.0.0.1:0", trust=trust_of(certs, ident.ROUTER),
                                 health_port=free_port())
    yield running
    await running.stop(service, 0)


async def list_replicas(channel: grpc.aio.Channel) -> grpc.StatusCode:
    try:
        await route_pb2_grpc.RouteServiceStub(channel).ListReplicas(route_pb2.ListReplicasRequest(), timeout=5)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def test_a_client_without_a_certificate_or_from_another_ca_or_in_plaintext_is_refused(
        certs: Path, router: Running, tmp_path: Path) -> None:
    address = f"127.0.0.1:{router.port}"
    name = [("grpc.ssl_target_name_override", "router.chatmesh")]
    async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes()),
                                       name) as no_cert:
        assert await list_replicas(no_cert) == grpc.StatusCode.UNAVAILABLE
    other = tmp_path / "other"
    pki.ensure(other)
    async with channels.open_channel(trust_of(other, ident.OPERATOR), address, "router") as foreign:
        assert await list_replicas(foreign) == grpc.StatusCode.UNAVAILABLE
    async with grpc.aio.insecure_channel(address) as plain:
        assert await list_replicas(plain) == grpc.StatusCode.UNAVAILABLE
    async with channels.open_channel(trust_of(certs, ident.OPERATOR), address, "router") as operator:
        assert await list_replicas(operator) == grpc.StatusCode.OK


async def test_a_client_refuses_a_server_whose_certificate_names_another_service(certs: Path, router: Running
                                                                               ) -> None:
    async with channels.open_channel(trust_of(certs, ident.CHAT), f"127.0.0.1:{router.port}", "store") as ch:
        assert await list_replicas(ch) == grpc.StatusCode.UNAVAILABLE


async def test_identities_outside_the_table_are_denied_naming_caller_and_rpc(certs: Path, router: Running) -> None:
    address = f"127.0.0.1:{router.port}"
    async with channels.open_channel(trust_of(certs, ident.ENGINE), address, "router") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await route_pb2_grpc.RouteServiceStub(ch).ListReplicas(route_pb2.ListReplicasRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert err.value.details() == \
            "spiffe://chatmesh/engine may not call /chatmesh.v1.RouteService/ListReplicas"
        # health is open to every authenticated peer
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_the_health_port_answers_health_in_plaintext_and_nothing_else(router: Running) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.health_port}") as ch:
        health = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="chatmesh.v1.RouteService"), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert await list_replicas(ch) == grpc.StatusCode.UNIMPLEMENTED


async def test_a_service_without_a_rule_for_every_rpc_does_not_start(certs: Path) -> None:
    service = route_service()
    service.authz = {"chatmesh.v1.RouteService": {"ListReplicas": [ident.CHAT]}}
    with pytest.raises(ValueError, match="no authorization rule for \\['PickReplica', 'ReleaseLease'\\]"):
        await start_server(service, "127.0.0.1:0", trust=trust_of(certs, ident.ROUTER))


async def test_a_handler_registered_beside_the_tables_is_refused_to_every_identity(certs: Path) -> None:
    """The check is in the handlers the bootstrap is given (authz.Guard), not in front of the server: a method a
    service's register hook adds with no rule (here a generic handler of a service outside its tables) is
    refused, never served unchecked."""
    served: list[bytes] = []

    async def echo(request: bytes, context: Any) -> bytes:
        served.append(request)
        return request

    service = route_service()
    register = service.register

    def register_more(server: grpc.aio.Server) -> list[str]:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "extra.Extra", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
        return list(register(server))

    service.register = register_more
    running = await start_server(service, "127.0.0.1:0", trust=trust_of(certs, ident.ROUTER))
    try:
        for who in (ident.OPERATOR, ident.CHAT):
            async with channels.open_channel(trust_of(certs, who), f"127.0.0.1:{running.port}", "router") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await ch.unary_unary("/extra.Extra/Echo", None, None)(b"hello", timeout=5)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert err.value.details() == f"{who} may not call /extra.Extra/Echo"
                assert await list_replicas(ch) == grpc.StatusCode.OK  # the tables' own RPCs still answer
        assert served == []
    finally:
        await running.stop(service, 0)


async def test_plaintext_is_refused_off_loopback() -> None:
    with pytest.raises(TrustRefused, match="loopback only"):
        await serve(route_service(), "0.0.0.0:0", 0, trust=Trust.insecure())
    with pytest.raises(TrustRefused):
        channels.open_channel(Trust.insecure(), "10.1.2.3:50052", "store")
    Trust.insecure().check_address("[::1]:50052", "listening on")  # loopback is fine


def served_serial(port: int, certs: Path) -> int:
    """The serial of the certificate the server presents to a new connection (Python's own TLS client)."""
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    ctx.load_cert_chain(certs / "operator.pem", certs / "operator-key.pem")
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="engine.chatmesh") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def serial_of(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


@pytest.fixture
def rotation_certs(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "certs"
    pki.ensure(folder)
    yield folder


async def test_rotating_certificates_under_an_open_stream(rotation_certs: Path) -> None:
    """Server and client certificates are replaced on disk while a stream is open: the stream finishes on its
    connection; new connections present (server) and send (client) the new certificates."""
    certs = rotation_certs
    servicer = SlowEngine()  # type: ignore[abstract]  # only Generate is called
    service = engine_service(servicer)
    server_trust, client_trust = trust_of(certs, ident.ENGINE), trust_of(certs, ident.CHAT)
    running = await start_server(service, "127.0.0.1:0", trust=server_trust)
    ca = pki.load_authority(certs)
    assert ca is not None and server_trust.tls is not None and client_trust.tls is not None
    try:
        old_server, old_client = serial_of(certs / "engine.pem"), serial_of(certs / "chat.pem")
        assert served_serial(running.port, certs) == old_server
        channel = channels.open_channel(client_trust, f"127.0.0.1:{running.port}", "engine")
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        stream = stub.Generate(generate_pb2.GenerateRequest(), timeout=20)
        first = await stream.read()
        assert isinstance(first, generate_pb2.GenerateResponse)
        pki.write_leaf(certs, ca, ident.ENGINE)
        pki.write_leaf(certs, ca, ident.CHAT)
        new_server, new_client = serial_of(certs / "engine.pem"), serial_of(certs / "chat.pem")
        # the check a new connection or call makes once a second, made now (test_a_change_is_seen_at_the_next_check
        # covers the once a second); the server's certificate fetcher and the channel then hand out what it read
        server_trust.tls.current(force=True)
        client_trust.tls.current(force=True)
        assert await asyncio.to_thread(served_serial, running.port, certs) == new_server != old_server
        second = [r async for r in stub.Generate(generate_pb2.GenerateRequest(), timeout=20)]
        rest: list[generate_pb2.GenerateResponse] = []
        while (item := await stream.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            assert isinstance(item, generate_pb2.GenerateResponse)
            rest.append(item)
        assert [r.delta.token_ids[0] for r in [first, *rest]] == [0, 1, 2, 3, 4]
        assert len(second) == 5
        assert servicer.client_serials == [old_client, new_client]
        await channel.close(None)
    finally:
        await running.stop(service, 0)


async def test_a_denied_call_is_logged_once_with_ids_only(certs: Path, router: Running,
                                                           captured: io.StringIO) -> None:
    async with channels.open_channel(trust_of(certs, ident.ENGINE), f"127.0.0.1:{router.port}", "router") as ch:
        assert await list_replicas(ch) == grpc.StatusCode.PERMISSION_DENIED
    denied = events(captured, "permission_denied")
    assert len(denied) == 1, captured.getvalue()
    assert denied[0]["caller"] == "spiffe://chatmesh/engine"
    assert denied[0]["rpc"] == "/chatmesh.v1.RouteService/ListReplicas"
    assert set(denied[0]) <= {"event", "caller", "rpc", "peer", "level", "timestamp", "service", "logger"}, denied[0]


def _client_cert(ca: pki.Authority, uris: list[str], start: datetime.datetime, days: float
                 ) -> tuple[bytes, bytes]:
    """A client certificate of the mesh's CA naming `uris`, valid from `start` for `days` (an outsider's try)."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "probe")]))
               .issuer_name(ca.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=days))
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if uris:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in uris]),
                                        critical=True)
    cert = builder.sign(ca.key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


async def test_expired_not_yet_valid_and_wrong_spiffe_id_certificates_of_the_mesh_ca_are_refused(
        certs: Path, router: Running) -> None:
    """Certificates the mesh's own CA signed: out of their validity window the handshake fails; in it, naming no
    identity of this trust domain (another trust domain, none at all, two at once) the call is denied by name."""
    ca = pki.load_authority(certs)
    assert ca is not None
    now = datetime.datetime.now(datetime.timezone.utc)
    address, name = f"127.0.0.1:{router.port}", [("grpc.ssl_target_name_override", "router.chatmesh")]
    cases: list[tuple[str, list[str], datetime.datetime, float, grpc.StatusCode]] = [
        ("expired", [ident.OPERATOR], now - datetime.timedelta(days=10), 1, grpc.StatusCode.UNAVAILABLE),
        ("not yet valid", [ident.OPERATOR], now + datetime.timedelta(days=1), 10, grpc.StatusCode.UNAVAILABLE),
        ("another trust domain", ["spiffe://other/operator"], now - datetime.timedelta(minutes=5), 1,
         grpc.StatusCode.PERMISSION_DENIED),
        ("no SPIFFE id", [], now - datetime.timedelta(minutes=5), 1, grpc.StatusCode.PERMISSION_DENIED),
        ("two identities", [ident.OPERATOR, ident.CHAT], now - datetime.timedelta(minutes=5), 1,
         grpc.StatusCode.PERMISSION_DENIED),
        ("a made-up service", ["spiffe://chatmesh/billing"], now - datetime.timedelta(minutes=5), 1,
         grpc.StatusCode.PERMISSION_DENIED),
    ]
    for what, uris, start, days, expected in cases:
        cert, key = _client_cert(ca, uris, start, days)
        credentials = grpc.ssl_channel_credentials((certs / pki.CA_FILE).read_bytes(), key, cert)
        async with grpc.aio.secure_channel(address, credentials, name) as channel:
            assert await list_replicas(channel) == expected, what
