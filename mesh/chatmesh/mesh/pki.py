"""Development certificates: a private CA and one certificate per mesh identity, made with `cryptography`.

`chatmesh up` and `chatmesh certs` call `ensure` on `<CHATMESH_DATA_DIR>/certs/`, and keep the keys apart the way
SPIFFE/SPIRE does (the CA in the issuer alone, each workload only its own key) and the Kubernetes manifests do
(deploy/k8s: each pod mounts its own Secret):

    <data>/ca/        ca.pem, ca-key.pem        the development CA (ECDSA P-256, 5 years). No service reads this
                                                folder: only `chatmesh certs` and `chatmesh up`, and the key only
                                                when they issue a certificate
    <data>/certs/     ca.pem                    the CA's certificate: every peer's trust bundle
                      <stem>.pem, <stem>-key.pem  one per identity (`identity.file_stem`: store, operator,
                                                client-dev, ...); each service reads its own pair only
                      owner-token-public-keys.json  the owner-token keys' public halves (what chat, the store and
                                                the engine verify with)
    <data>/gateway/   owner-token-keys.json     the owner-token signing keys (tokens.py): the gateway's alone

Folders are 0700 and private keys 0600. Every service refuses to start with a private key any user of the
machine may read (`check_private`); `chatmesh up` checks the whole layout (`check_layout`) and says that its
services share one user, so here only the paths keep them apart (in production each runs as its own user or
pod). A data folder of the earlier layout (everything in certs/) is moved into this one by `ensure`.

A leaf certificate (ECDSA P-256, 90 days) names its identity as a URI SAN (`spiffe://chatmesh/store`) and, for a
service, the DNS SAN its clients verify (`store.chatmesh`); services may serve and call (server and client
auth), the operator and clients only call. Existing files are kept; a leaf is re-issued when it is missing, not
signed by the CA on disk, or within `RENEW_WITHIN` of expiry, so rerunning renews what needs it. Files are
replaced atomically (write, then rename), so a service reloading them never reads half a file.
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
CA_FOLDER, ISSUER_FOLDER = "ca", "gateway"  # beside the certs folder (see the module header)


def ca_folder(certs: Path) -> Path:
    """Where the CA's key is kept, beside the certs folder every service reads from."""
    return certs.parent / CA_FOLDER


def private_keys_file(certs: Path) -> Path:
    """The owner-token signing keys (the gateway's), beside the certs folder."""
    return certs.parent / ISSUER_FOLDER / TOKEN_KEYS_FILE


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


def load_ca_cert(certs: Path) -> x509.Certificate | None:
    path = ca_folder(certs) / CA_FILE
    return x509.load_pem_x509_certificate(path.read_bytes()) if path.is_file() else None


def load_authority(certs: Path) -> Authority | None:
    """The CA of the certs folder `certs` (its certificate and key, from the CA folder beside it)."""
    folder = ca_folder(certs)
    cert_path, key_path = folder / CA_FILE, folder / CA_KEY_FILE
    if not cert_path.is_file() or not key_path.is_file():
        return None
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{key_path}: expected an EC private key")
    return Authority(cert, key)


def _needs_leaf(ca: x509.Certificate, cert_path: Path, key_path: Path) -> bool:
    if not cert_path.is_file() or not key_path.is_file():
        return True
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return True
    return cert.not_valid_after_utc - _now() < RENEW_WITHIN


def _private_folder(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)


def _migrate(certs: Path) -> None:
    """Moves the CA key and the signing keys out of a certs folder of the earlier layout (all in one folder)."""
    for old, new in ((certs / CA_KEY_FILE, ca_folder(certs) / CA_KEY_FILE),
                     (certs / TOKEN_KEYS_FILE, private_keys_file(certs))):
        if not old.is_file():
            continue
        if not new.exists():
            _private_folder(new.parent)
            os.replace(old, new)
            if old.name == CA_KEY_FILE and (certs / CA_FILE).is_file():
                write_atomic(new.parent / CA_FILE, (certs / CA_FILE).read_bytes())
        else:
            old.unlink()  # a copy left behind: the folder beside it holds the one in use


def ensure(folder: Path, identities: Iterable[Identity] | None = None) -> list[Identity]:
    """Makes whatever of the development PKI and token keys is missing or due under the certs folder `folder` and
    the folders beside it; returns the identities (re)issued. The CA key is read only to issue."""
    _private_folder(folder)
    _migrate(folder)
    ca_cert = load_ca_cert(folder)
    ca: Authority | None = None
    if ca_cert is None or not (ca_folder(folder) / CA_KEY_FILE).is_file():
        ca = new_authority()
        _private_folder(ca_folder(folder))
        write_atomic(ca_folder(folder) / CA_KEY_FILE, _key_pem(ca.key), 0o600)
        write_atomic(ca_folder(folder) / CA_FILE, ca.pem)
        ca_cert = ca.cert
    bundle = ca_cert.public_bytes(serialization.Encoding.PEM)
    if not (folder / CA_FILE).is_file() or (folder / CA_FILE).read_bytes() != bundle:
        write_atomic(folder / CA_FILE, bundle)
    issued = []
    for who in identities if identities is not None else default_identities():
        stem = ident.file_stem(who)
        if _needs_leaf(ca_cert, folder / f"{stem}.pem", folder / f"{stem}-key.pem"):
            ca = ca or load_authority(folder)
            assert ca is not None  # its files were there a moment ago
            write_leaf(folder, ca, who)
            issued.append(who)
    if not private_keys_file(folder).is_file():
        _write_keys(folder, tokens.KeySet.generate())
    return issued


def check_private(path: Path) -> str | None:
    """Why the private key at `path` is not kept private (None: it is): a key every user of the machine may read
    is readable by every other service's identity, whatever user each runs as."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o004:
        return f"{path} is readable by every user of this machine (mode {mode:o}); `chmod 600 {path}`"
    return None


def check_layout(folder: Path) -> tuple[list[str], list[str]]:
    """(refusals, notes) for the development files of the certs folder `folder` and the folders beside it, as
    `chatmesh up` starts: a private key or private folder others than its owner may open, or a key in the folder
    every service reads, is refused; that every service here runs as one user (so only the paths keep their keys
    apart) is a note."""
    refusals: list[str] = []
    for key in [ca_folder(folder) / CA_KEY_FILE, private_keys_file(folder), *sorted(folder.glob("*-key.pem"))]:
        if key.is_file() and (mode := key.stat().st_mode & 0o777) & 0o077:
            refusals.append(f"{key} may be read by others than its owner (mode {mode:o}); `chmod 600 {key}`")
    for private in (ca_folder(folder), private_keys_file(folder).parent):
        if private.is_dir() and (mode := private.stat().st_mode & 0o777) & 0o077:
            refusals.append(f"{private} is open to others than its owner (mode {mode:o}); `chmod 700 {private}`")
    for stray, home in ((folder / CA_KEY_FILE, ca_folder(folder)), (folder / TOKEN_KEYS_FILE,
                                                                     private_keys_file(folder).parent)):
        if stray.exists():
            refusals.append(f"{stray} is in the folder every service reads; it belongs in {home}")
    notes = [f"every service runs as user {os.getuid()} here, so file permissions cannot keep one from reading "
             f"another's key: each is configured with its own files only (none with {ca_folder(folder)}, the "
             f"gateway alone with {private_keys_file(folder).parent})"]
    return refusals, notes


def _write_keys(folder: Path, keys: tokens.KeySet) -> str:
    # the public file first, so verifiers know a new key before the gateway signs with it
    write_atomic(folder / TOKEN_PUBLIC_KEYS_FILE, keys.to_json(private=False))
    _private_folder(private_keys_file(folder).parent)
    write_atomic(private_keys_file(folder), keys.to_json(private=True), 0o600)
    return keys.signing_key_id


def rotate_token_key(folder: Path, retire: Iterable[str] = ()) -> str:
    """Adds a new signing key (old ones stay, to verify tokens already out) and drops `retire`d key ids.
    Returns the new signing key id."""
    return _write_keys(folder, tokens.KeySet.from_json(private_keys_file(folder).read_bytes())
                       .rotated().without(retire))


def retire_token_keys(folder: Path, retire: Iterable[str]) -> str:
    return _write_keys(folder, tokens.KeySet.from_json(private_keys_file(folder).read_bytes()).without(retire))
