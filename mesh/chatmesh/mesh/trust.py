"""What one process trusts and proves: its identity, its TLS material, the owner-token keys it verifies with.

`Trust.from_config(cfg, who)` is read once at start-up by every service (`chatmesh serve`) and by tools acting as
an identity (`Mesh`, tests, the operator's scripts):

- mutual TLS (the default): the certificate (CHATMESH_MESH_CERT_FILE, default
  `<CHATMESH_DATA_DIR>/certs/<stem>.pem`, with `-key.pem` and `ca.pem` beside it) must name `who`; owner tokens
  are verified with CHATMESH_OWNER_TOKEN_KEYS_FILE (default: the public key set beside the certificates).
- CHATMESH_MESH_PLAINTEXT=true: no TLS, no identities, no owner tokens (every peer may call every RPC and an
  owner id in a request is believed). Only on loopback: `check_address` refuses to listen on, or dial, any other
  address in the clear.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from chatmesh.mesh import identity as ident
from chatmesh.mesh import pki, settings, tls, tokens
from chatmesh.mesh.tls import Pems, TlsFiles
from chatmesh.mesh.config import Config
from chatmesh.mesh.errors import FailedPrecondition
from chatmesh.mesh.identity import Identity
from chatmesh.mesh.reload import Watched


class TrustRefused(FailedPrecondition):
    """The trust settings are unsafe or incomplete (plaintext off loopback, certificates missing)."""


def host_of(address: str) -> str:
    for scheme in ("ipv4:", "ipv6:", "dns:///", "dns:"):
        address = address.removeprefix(scheme)
    if address.startswith("["):
        return address[1:].partition("]")[0]
    return address.rpartition(":")[0] if address.count(":") == 1 else address


def is_loopback(address: str) -> bool:
    host = host_of(address)
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Trust:
    identity: Identity | None  # None: plaintext
    tls: Watched[Pems] | None
    verifier: tokens.Verifier | None
    authz_file: Path | None = None

    @property
    def plaintext(self) -> bool:
        return self.tls is None

    @classmethod
    def insecure(cls) -> Trust:
        """Plaintext: only for loopback (checked where addresses are used)."""
        return cls(None, None, None)

    @classmethod
    def from_files(cls, files: TlsFiles, who: Identity, keys_file: Path | None,
                   authz_file: Path | None = None, token_ttl_s: int = settings.OWNER_TOKEN_TTL_S.default) -> Trust:
        missing = [str(p) for p in (files.ca, files.cert, files.key) if not p.is_file()]
        if missing:
            raise TrustRefused(
                f"{who}: mutual TLS needs {', '.join(missing)}; run `chatmesh certs` (development certificates "
                f"under <CHATMESH_DATA_DIR>/certs/) or set CHATMESH_MESH_CA_FILE, CHATMESH_MESH_CERT_FILE and "
                f"CHATMESH_MESH_KEY_FILE (plaintext, loopback only: CHATMESH_MESH_PLAINTEXT=true)")
        try:
            watched = tls.watch(files, expect=who)
        except ValueError as err:
            raise TrustRefused(str(err)) from None
        _kept_private(who, files.key)
        verifier = None
        if keys_file is not None:
            if not keys_file.is_file():
                raise TrustRefused(f"{who}: owner-token keys {keys_file} not found; run `chatmesh certs` or set "
                                   f"CHATMESH_OWNER_TOKEN_KEYS_FILE")
            try:
                verifier = tokens.Verifier(tokens.watch_keys(keys_file), token_ttl_s)
            except ValueError as err:
                raise TrustRefused(str(err)) from None
            if any(k.private is not None for k in verifier.keys.current().keys.values()):
                _kept_private(who, keys_file)
        return cls(who, watched, verifier, authz_file)

    @classmethod
    def from_config(cls, cfg: Config, who: Identity, issuer: bool = False) -> Trust:
        if cfg[settings.MESH_PLAINTEXT]:
            return cls.insecure()
        files = tls_files(cfg, who)
        keys = tokens.keys_file(cfg[settings.OWNER_TOKEN_KEYS_FILE], cfg[settings.DATA_DIR], issuer)
        authz = cfg[settings.MESH_AUTHZ_FILE]
        return cls.from_files(files, who, keys, Path(authz).expanduser() if authz else None,
                              cfg[settings.OWNER_TOKEN_TTL_S])

    def check_address(self, address: str, what: str) -> None:
        """Refuses plaintext to or from anything but loopback."""
        if self.plaintext and not is_loopback(address):
            raise TrustRefused(
                f"{what} {address} in plaintext refused: CHATMESH_MESH_PLAINTEXT serves and dials loopback only; "
                f"use mutual TLS (CHATMESH_MESH_CERT_FILE, ...) for any other address")


def _kept_private(who: Identity, key: Path) -> None:
    """Refuses to start with a private key every user of the machine may read (pki.check_private)."""
    why = pki.check_private(key)
    if why is not None:
        raise TrustRefused(f"{who}: refusing a private key others can read: {why}")


def tls_files(cfg: Config, who: Identity) -> TlsFiles:
    """The CA bundle, certificate and key the settings name for `who` (default: its development files)."""
    default = TlsFiles.in_folder(certs_folder(cfg), who)
    return TlsFiles(
        ca=Path(cfg[settings.MESH_CA_FILE]).expanduser() if cfg[settings.MESH_CA_FILE] else default.ca,
        cert=Path(cfg[settings.MESH_CERT_FILE]).expanduser() if cfg[settings.MESH_CERT_FILE] else default.cert,
        key=Path(cfg[settings.MESH_KEY_FILE]).expanduser() if cfg[settings.MESH_KEY_FILE] else default.key)


def certs_folder(cfg: Config) -> Path:
    return Path(os.path.expanduser(cfg[settings.DATA_DIR])) / "certs"


def service_trust(cfg: Config, service_name: str) -> Trust:
    """The trust of a `chatmesh serve SERVICE` process (the gateway also issues tokens: private keys)."""
    return Trust.from_config(cfg, ident.service(service_name), issuer=service_name == "gateway")
