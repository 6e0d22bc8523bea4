"""engine -> Triton over mutual TLS, against the real tritonserver from nvidia-pytriton: Triton serves the engine's
mesh certificate and requires a client certificate of the mesh CA; the engine's client presents its own. A
client in plaintext, without a certificate, or with one from another CA gets nothing. The `triton` backend built
from the settings (CHATMESH_TRITON_TLS=auto, the mesh in mutual TLS) starts its Triton that way and generates
through it."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from chatmesh.engine_adapter.backend import Delta, Finished, GenerateParams, Started
from chatmesh.engine_adapter.service import build_backend
from chatmesh.engine_adapter.triton import tls as triton_tls
from chatmesh.engine_adapter.triton.backend import TritonBackend
from chatmesh.engine_adapter.triton.launcher import TritonServer
from chatmesh.engine_adapter.triton.tls import TritonTls
from chatmesh.mesh import identity as ident
from chatmesh.mesh import pki
from chatmesh.mesh.config import Config
from chatmesh.mesh.tls import TlsFiles
from chatmesh.mesh.trust import TrustRefused
from tests.triton.test_triton_launcher import MODELS, _install, echo


def engine_tls(certs: Path) -> TritonTls:
    pki.ensure(certs)
    return TritonTls(TlsFiles.in_folder(certs, ident.ENGINE))


def answers(client: object) -> bool:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    assert isinstance(client, grpcclient.InferenceServerClient)
    try:
        return bool(client.is_server_ready(client_timeout=5))
    except InferenceServerException:
        return False
    finally:
        client.close()


def served_certificate(address: str, certs: Path) -> x509.Certificate:
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    ctx.load_cert_chain(certs / "engine.pem", certs / "engine-key.pem")
    ctx.set_alpn_protocols(["h2"])
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname=triton_tls.SERVER_NAME) as conn:
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def test_triton_serves_mutual_tls_with_the_engines_certificate_and_refuses_other_clients(tmp_path: Path) -> None:
    import tritonclient.grpc as grpcclient

    certs = tmp_path / "certs"
    tls = engine_tls(certs)
    other = tmp_path / "other" / "certs"
    pki.ensure(other)
    server = TritonServer(MODELS, models=["echo"], install=_install(), tls=tls, work_dir=tmp_path / "work")
    server.start()  # readiness is asked over mutual TLS too
    try:
        client = grpcclient.InferenceServerClient(server.address, **tls.client_kwargs())
        try:
            assert echo(client) == [5, 6, 7]
        finally:
            client.close()
        served = served_certificate(server.address, certs)
        assert served.serial_number == x509.load_pem_x509_certificate((certs / "engine.pem").read_bytes()).serial_number
        ca = (certs / "ca.pem").read_bytes()
        name = [("grpc.ssl_target_name_override", triton_tls.SERVER_NAME)]
        assert not answers(grpcclient.InferenceServerClient(server.address))  # plaintext
        assert not answers(grpcclient.InferenceServerClient(  # TLS without a client certificate
            server.address, creds=grpc.ssl_channel_credentials(ca), channel_args=name))
        foreign = grpc.ssl_channel_credentials(ca, (other / "engine-key.pem").read_bytes(),
                                               (other / "engine.pem").read_bytes())
        assert not answers(grpcclient.InferenceServerClient(server.address, creds=foreign, channel_args=name))
        assert answers(grpcclient.InferenceServerClient(server.address, **tls.client_kwargs()))
    finally:
        server.stop()


async def test_the_backend_from_the_settings_starts_triton_in_mutual_tls_and_generates_through_it(
        tmp_path: Path) -> None:
    import tritonclient.grpc as grpcclient

    _install()
    pki.ensure(tmp_path / "certs")
    backend = build_backend(Config(env={
        "CHATMESH_ENGINE": "triton", "CHATMESH_DATA_DIR": str(tmp_path), "CHATMESH_TRITON_ENGINE": "sim",
        "CHATMESH_SIM_STEP_MS": "10", "CHATMESH_SIM_TEXT": "words", "CHATMESH_DEVICE_BLOCKS": "256",
        "CHATMESH_HOST_BLOCKS": "0"}))
    assert isinstance(backend, TritonBackend) and backend.server is not None
    assert backend.server.tls is not None and backend.server.tls.files.cert == tmp_path / "certs" / "engine.pem"
    await backend.start()
    try:
        assert backend.ready()
        events = [e async for e in backend.generate(GenerateParams(prompt_token_ids=tuple(range(100, 140)),
                                                                   max_tokens=4, cache_salt=b"owner"))]
        assert isinstance(events[0], Started) and isinstance(events[-1], Finished)
        assert any(isinstance(e, Delta) for e in events)
        assert not answers(grpcclient.InferenceServerClient(backend.address))  # its Triton takes no plaintext
    finally:
        await backend.close()


def test_when_the_engine_speaks_tls_to_triton(tmp_path: Path) -> None:
    pki.ensure(tmp_path / "certs")
    base = {"CHATMESH_DATA_DIR": str(tmp_path)}

    def mode(address: str, **env: str) -> TritonTls | None:
        return triton_tls.from_config(Config(env={**base, **env}), address)

    assert mode("") is not None  # a Triton the engine starts itself
    assert mode("node-07:8001") is not None  # a remote one
    assert mode("127.0.0.1:8001") is None  # a sidecar on loopback in the engine's pod
    assert mode("127.0.0.1:8001", CHATMESH_TRITON_TLS="on") is not None
    assert mode("", CHATMESH_TRITON_TLS="off") is None
    for plaintext in ({"CHATMESH_TRITON_TLS": "off"}, {"CHATMESH_MESH_PLAINTEXT": "true"}):
        with pytest.raises(TrustRefused, match="plaintext is for loopback only"):
            mode("node-07:8001", **plaintext)
    with pytest.raises(TrustRefused, match="engine's mesh certificate"):
        triton_tls.from_config(Config(env={"CHATMESH_DATA_DIR": str(tmp_path / "empty")}), "")
    assert mode("", CHATMESH_MESH_PLAINTEXT="true") is None  # a plaintext mesh: plaintext Triton on loopback
