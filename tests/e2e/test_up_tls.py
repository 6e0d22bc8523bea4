"""`chatmesh up` with HTTPS at the edge (issue 17: with CHATMESH_TLS_CERT/KEY set it used to wait for the gateway
over http://, call it unhealthy after 120 s and tear the mesh down).

The command itself runs, as from a shell, with an edge certificate for 127.0.0.1 and localhost signed by the
development CA that `chatmesh up` makes under <CHATMESH_DATA_DIR>/certs/ (the test issues the leaf: `chatmesh up`
makes the mesh's identities, not a certificate for the edge's public name). It must report the gateway ready at
an https:// URL, serve a turn over TLS to a client that trusts only that CA, refuse plain HTTP, and stop cleanly."""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import ssl
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from chatmesh.mesh import pki
from tests.conftest import free_port
from tests.e2e.conftest import mesh_env, read_sse

pytestmark = pytest.mark.slow


def edge_certificate(ca: pki.Authority, folder: Path) -> tuple[Path, Path]:
    """A server certificate for 127.0.0.1 and localhost signed by `ca`."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "chatmesh edge")]))
            .issuer_name(ca.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca.key, hashes.SHA256()))
    cert_path, key_path = folder / "edge.pem", folder / "edge-key.pem"
    pki.write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    pki.write_atomic(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()), 0o600)
    return cert_path, key_path


def _wait_for_line(log: Path, proc: subprocess.Popen[bytes], needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if needle in text:
            return text
        if proc.poll() is not None:
            raise AssertionError(f"chatmesh up exited with {proc.returncode}:\n{text[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {needle!r} from chatmesh up within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def test_chatmesh_up_serves_https_with_the_development_ca(tmp_path: Path) -> None:
    data = tmp_path / "data"
    certs = data / "certs"
    pki.ensure(certs)  # what `chatmesh up` does first (it keeps existing files)
    ca = pki.load_authority(certs)
    assert ca is not None
    cert, key = edge_certificate(ca, tmp_path)
    env = {**os.environ, **mesh_env(data), "CHATMESH_TLS_CERT": str(cert), "CHATMESH_TLS_KEY": str(key),
           "CHATMESH_KEY_PEPPER": "a-test-pepper",  # TLS at the edge: the development pepper is refused
           "CHATMESH_OWNER_TOKEN_ADDRESS": f"127.0.0.1:{free_port()}"}
    port = env["CHATMESH_GATEWAY_PORT"]
    out, err = tmp_path / "up.out", tmp_path / "up.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "chatmesh.mesh.cli", "up"], env=env, stdout=stdout,
                                stderr=stderr, stdin=subprocess.DEVNULL)
    try:
        progress = _wait_for_line(err, proc, "gateway    ready", 150)
        assert f"gateway    ready at https://127.0.0.1:{port}" in progress, progress[-2000:]
        banner = _wait_for_line(out, proc, "chatmesh is up", 30)
        assert f"Open https://127.0.0.1:{port}/" in banner

        trusted = ssl.create_default_context(cafile=str(certs / pki.CA_FILE))
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=trusted, timeout=60) as client:
            assert client.get("/healthz").status_code == 200
            conv = client.post("/v1/conversations", json={}).json()["id"]
            with client.stream("POST", f"/v1/conversations/{conv}/turns",
                               json={"turn_id": str(uuid.uuid4()), "content": "Hello over TLS"}) as r:
                assert r.status_code == 200
                kinds = [e.event for e in read_sse(r)]
            assert kinds[0] == "turn.started" and kinds[-1] == "turn.completed"
            session = client.get("/v1/session")
            assert session.status_code == 200
        with pytest.raises(httpx.TransportError):  # HTTPS only: plain HTTP on the edge's port gets no answer
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        with pytest.raises(httpx.ConnectError):  # and a client that does not trust the development CA refuses
            httpx.get(f"https://127.0.0.1:{port}/healthz", timeout=5)
        assert proc.poll() is None  # the mesh stayed up
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    assert code == 0, err.read_text()[-2000:]
