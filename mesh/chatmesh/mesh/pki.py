"""Development certificates: a private CA and one certificate per mesh identity, made with `cryptography`.

`chatmesh up` and `chatmesh certs` call `ensure` on `<CHATMESH_DATA_DIR>/certs/`:

    ca.pem, ca-key.pem                    the development CA (ECDSA P-256, 5 years); ca.pem is every peer's trust
    <stem>.pem, <stem>-key.pem            one per identity (`identity.file_stem`: store, operator, client-dev, ...)
    owner-token-keys.json                 owner-token signing keys (the gateway's; tokens.py)
    owner-token-public-keys.json          the same keys' public halves (what chat, store and engine verify with)

A leaf certificate (ECDSA P-256, 90 days) names its identity as a URI SAN (`spiffe://chatmesh/store`) and, for a
service, the DNS SAN its clients verify (`store.chatmesh`); services may serve and call (server and client
auth), the operator and clients only call. Existing files are kept; a leaf is re-issued when it is missing, not
signed by the CA on disk, or within `RENEW_WITHIN` of expiry, so rerunning renews what needs it. Files are
replaced atomically (write, then rename), so a service reloading them never reads half a file; private keys are
mode 0600.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from chatmesh.mesh import identity as ident
from chatmesh.mesh import tokens
from chatmesh.mesh.identity import Identity

CA_DAYS = 5 * 365
LEAF_DAYS = 90
RENEW_WITHIN = datetime.timedelta(days=14)
CA_FILE, CA_KEY_FILE = "ca.pem", "ca-key.pem"
TOKEN_KEYS_FILE, TOKEN_PUBLIC_KEYS_FILE = tokens.KEYS_FILE, tokens.PUBLIC_KEYS_FILE


def default_identities(clients: Iterable[str] = ("dev",)) -> list[Identity]:
    """Every service, the operator, and the named clients (`chatmesh up` makes `client/dev` for the README)."""
    return [*(ident.service(s) for s in ident.SERVICES), ident.OPERATOR, *(ident.client(c) for c in clients)]


@dataclass(frozen=True)
class Authority:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def new_authority(name: str = "chatmesh development CA", days: int = CA_DAYS) -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} {_now():%Y-%m-%d %H:%M:%S}")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return Authority(cert, key)


def issue(ca: Authority, who: Identity, days: int = LEAF_DAYS,
          not_before: datetime.datetime | None = None) -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM) for `who`, signed by `ca`."""
    key = ec.generate_private_key(ec.SECP256R1())
    stem = ident.file_stem(who)
    is_service = stem in ident.SERVICES
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(who)]
    if is_service:
        names.append(x509.DNSName(ident.server_name(stem)))
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if is_service \
        else [ExtendedKeyUsageOID.CLIENT_AUTH]
    start = not_before or _now() - datetime.timedelta(minutes=5)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, stem)]))
            .issuer_name(ca.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.SubjectAlternativeName(names), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
            .sign(ca.key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def write_leaf(folder: Path, ca: Authority, who: Identity, days: int = LEAF_DAYS,
               not_before: datetime.datetime | None = None) -> tuple[Path, Path]:
    """Issues `who` a certificate and writes it, key first (a reader meeting the new key with the old
    certificate refuses the pair and keeps what it had until the certificate follows: tls.py)."""
    cert_pem, key_pem = issue(ca, who, days, not_before)
    stem = ident.file_stem(who)
    key_path, cert_path = folder / f"{stem}-key.pem", folder / f"{stem}.pem"
    write_atomic(key_path, key_pem, 0o600)
    write_atomic(cert_path, cert_pem)
    return cert_path, key_path


def load_authority(folder: Path) -> Authority | None:
    cert_path, key_path = folder / CA_FILE, folder / CA_KEY_FILE
    if not cert_path.is_file() or not key_path.is_file():
        return None
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{key_path}: expected an EC private key")
    return Authority(cert, key)


def _needs_leaf(ca: Authority, cert_path: Path, key_path: Path) -> bool:
    if not cert_path.is_file() or not key_path.is_file():
        return True
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    try:
        cert.verify_directly_issued_by(ca.cert)
    except (ValueError, TypeError, InvalidSignature):
        return True
    return cert.not_valid_after_utc - _now() < RENEW_WITHIN


def ensure(folder: Path, identities: Iterable[Identity] | None = None) -> list[Identity]:
    """Makes whatever of the development PKI and token keys is missing or due; returns the identities (re)issued."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    ca = load_authority(folder)
    if ca is None:
        ca = new_authority()
        write_atomic(folder / CA_KEY_FILE, _key_pem(ca.key), 0o600)
        write_atomic(folder / CA_FILE, ca.pem)
    issued = []
    for who in identities if identities is not None else default_identities():
        stem = ident.file_stem(who)
        if _needs_leaf(ca, folder / f"{stem}.pem", folder / f"{stem}-key.pem"):
            write_leaf(folder, ca, who)
            issued.append(who)
    if not (folder / TOKEN_KEYS_FILE).is_file():
        _write_keys(folder, tokens.KeySet.generate())
    return issued


def _write_keys(folder: Path, keys: tokens.KeySet) -> str:
    # the public file first, so verifiers know a new key before the gateway signs with it
    write_atomic(folder / TOKEN_PUBLIC_KEYS_FILE, keys.to_json(private=False))
    write_atomic(folder / TOKEN_KEYS_FILE, keys.to_json(private=True), 0o600)
    return keys.signing_key_id


def rotate_token_key(folder: Path, retire: Iterable[str] = ()) -> str:
    """Adds a new signing key (old ones stay, to verify tokens already out) and drops `retire`d key ids.
    Returns the new signing key id."""
    return _write_keys(folder, tokens.KeySet.from_json((folder / TOKEN_KEYS_FILE).read_bytes())
                       .rotated().without(retire))


def retire_token_keys(folder: Path, retire: Iterable[str]) -> str:
    return _write_keys(folder, tokens.KeySet.from_json((folder / TOKEN_KEYS_FILE).read_bytes()).without(retire))
