"""Mutual TLS material from files: a CA bundle, a certificate chain and its private key, reloaded on change.

`watch(files)` parses the three PEM files into `Pems` and keeps them current (`reload.Watched`): a new key pair
is taken only when the certificate matches the key and names the process's own identity; otherwise the old pair
stays (a rotation that writes the key before the certificate is picked up at the check after the second write).
Whether the chain leads to a trusted CA is the peers' check, at the handshake.

Servers: `server_credentials` hands gRPC a certificate-configuration fetcher, which gRPC calls before every new
TLS handshake; it returns the new configuration once after each reload and None otherwise, so new connections
get the new certificate while open connections (and their streams) keep the one they were made with. Client
certificates are required and verified against the CA bundle. Clients: `channel_credentials` for one channel;
channels.py makes a new channel for new calls after a reload.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from chatmesh.mesh import identity as ident
from chatmesh.mesh.identity import Identity
from chatmesh.mesh.reload import Watched


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_folder(cls, folder: Path, who: Identity) -> TlsFiles:
        stem = ident.file_stem(who)
        return cls(folder / "ca.pem", folder / f"{stem}.pem", folder / f"{stem}-key.pem")


@dataclass(frozen=True)
class Pems:
    ca: bytes
    cert: bytes
    key: bytes
    identity: Identity
    serial: int


def _public_der(key: object) -> bytes:
    public_bytes = getattr(key, "public_bytes")
    der: bytes = public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return der


def identity_of(cert: x509.Certificate) -> Identity | None:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    found = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(ident.PREFIX)]
    if len(found) != 1:
        return None
    try:
        return ident.parse(found[0])
    except ValueError:
        return None


def parse_pems(ca: bytes, cert: bytes, key: bytes, expect: Identity | None = None,
               source: str = "mesh certificate") -> Pems:
    """Checks that the pair matches, names one chatmesh identity (`expect`, when given) and that the CA bundle
    parses; ValueError otherwise (a reload then keeps the previous pair)."""
    try:
        cas = x509.load_pem_x509_certificates(ca)
        chain = x509.load_pem_x509_certificates(cert)
        private = serialization.load_pem_private_key(key, password=None)
    except ValueError as err:
        raise ValueError(f"{source}: unreadable PEM ({err})") from None
    if not cas:
        raise ValueError(f"{source}: the CA bundle holds no certificate")
    leaf = chain[0]
    if _public_der(private.public_key()) != _public_der(leaf.public_key()):
        raise ValueError(f"{source}: the private key does not match the certificate")
    who = identity_of(leaf)
    if who is None:
        raise ValueError(f"{source}: the certificate names no chatmesh identity (a URI SAN {ident.PREFIX}...)")
    if expect is not None and who != expect:
        raise ValueError(f"{source}: the certificate is for {who}, but this process is {expect}")
    return Pems(ca, cert, key, who, leaf.serial_number)


def watch(files: TlsFiles, expect: Identity | None = None) -> Watched[Pems]:
    def parse(data: Sequence[bytes]) -> Pems:
        return parse_pems(data[0], data[1], data[2], expect, f"{files.cert} ({files.key}, CA {files.ca})")

    return Watched([files.ca, files.cert, files.key], parse)


def _server_config(p: Pems) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(p.key, p.cert)], root_certificates=p.ca)


def server_credentials(watched: Watched[Pems]) -> grpc.ServerCredentials:
    served = [watched.current()]

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        current = watched.current()
        if current is served[0]:
            return None
        served[0] = current
        return _server_config(current)

    return grpc.dynamic_ssl_server_credentials(_server_config(served[0]), fetch,  # type: ignore[arg-type]
                                               require_client_authentication=True)


def channel_credentials(p: Pems) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=p.ca, private_key=p.key, certificate_chain=p.cert)
