"""The development PKI keeps keys apart (pki.py): the CA's key beside, not in, the folder every service reads and
read only to issue; the owner-token signing keys the gateway's alone; each service configured with its own key
only; loose permissions refused, by `chatmesh up` and by every service at start; an earlier layout moved."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cryptography import x509

from chatmesh.mesh import identity as ident
from chatmesh.mesh import pki, tokens
from chatmesh.mesh.config import Config
from chatmesh.mesh.trust import Trust, TrustRefused, service_trust


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_the_ca_key_and_the_signing_keys_sit_apart_from_the_certs_folder(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    pki.ensure(certs)
    assert not (certs / pki.CA_KEY_FILE).exists() and not (certs / pki.TOKEN_KEYS_FILE).exists()
    assert (tmp_path / "ca" / pki.CA_KEY_FILE).is_file()
    assert pki.private_keys_file(certs) == tmp_path / "gateway" / pki.TOKEN_KEYS_FILE
    assert (certs / pki.CA_FILE).read_bytes() == (tmp_path / "ca" / pki.CA_FILE).read_bytes()
    assert _mode(tmp_path / "ca") == _mode(tmp_path / "gateway") == _mode(certs) == 0o700
    assert {_mode(k) for k in [tmp_path / "ca" / pki.CA_KEY_FILE, pki.private_keys_file(certs),
                               *certs.glob("*-key.pem")]} == {0o600}
    refusals, notes = pki.check_layout(certs)
    assert refusals == [] and "runs as user" in notes[0]


def test_each_service_is_configured_with_its_own_key_and_only_the_gateway_with_the_signing_keys(
        tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    pki.ensure(certs)
    cfg = Config(env={"CHATMESH_DATA_DIR": str(tmp_path)})
    for service in ident.SERVICES:
        trust = service_trust(cfg, service)
        assert trust.tls is not None and trust.verifier is not None
        read = {str(p) for p in (*trust.tls.paths, *trust.verifier.keys.paths)}
        assert read == {str(certs / pki.CA_FILE), str(certs / f"{service}.pem"), str(certs / f"{service}-key.pem"),
                        str(pki.private_keys_file(certs) if service == "gateway" else certs / pki.TOKEN_PUBLIC_KEYS_FILE)}
        assert not any(p.startswith(str(tmp_path / "ca")) for p in read)
        private = [k for k in trust.verifier.keys.current().keys.values() if k.private is not None]
        assert bool(private) == (service == "gateway")


def test_ensure_reads_the_ca_key_only_to_issue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    certs = tmp_path / "certs"
    pki.ensure(certs)

    def no(_: Path) -> None:
        raise AssertionError("the CA key was read with nothing to issue")

    monkeypatch.setattr(pki, "load_authority", no)
    assert pki.ensure(certs) == []  # everything current: `chatmesh up` starts without touching the key
    monkeypatch.undo()
    (certs / "store.pem").unlink()
    assert pki.ensure(certs) == [ident.STORE]


def test_an_earlier_layout_is_moved_without_reissuing(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    pki.ensure(certs)
    serial = x509.load_pem_x509_certificate((certs / "chat.pem").read_bytes()).serial_number
    os.replace(tmp_path / "ca" / pki.CA_KEY_FILE, certs / pki.CA_KEY_FILE)  # as the earlier `chatmesh up` left it
    os.replace(pki.private_keys_file(certs), certs / pki.TOKEN_KEYS_FILE)
    assert pki.check_layout(certs)[0] != []
    assert pki.ensure(certs) == []
    assert not (certs / pki.CA_KEY_FILE).exists() and (tmp_path / "ca" / pki.CA_KEY_FILE).is_file()
    assert not (certs / pki.TOKEN_KEYS_FILE).exists() and pki.private_keys_file(certs).is_file()
    assert x509.load_pem_x509_certificate((certs / "chat.pem").read_bytes()).serial_number == serial
    assert pki.check_layout(certs)[0] == []


def test_a_key_others_may_read_is_refused_by_up_and_by_the_service(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    pki.ensure(certs)
    cfg = Config(env={"CHATMESH_DATA_DIR": str(tmp_path)})
    os.chmod(certs / "store-key.pem", 0o640)
    assert any("store-key.pem may be read by others" in r for r in pki.check_layout(certs)[0])
    service_trust(cfg, "store")  # group-readable: a Kubernetes Secret with fsGroup is mounted so; a service takes it
    os.chmod(certs / "store-key.pem", 0o644)
    with pytest.raises(TrustRefused, match="store-key.pem is readable by every user"):
        service_trust(cfg, "store")
    os.chmod(pki.private_keys_file(certs), 0o604)
    with pytest.raises(TrustRefused, match="owner-token-keys.json is readable by every user"):
        service_trust(cfg, "gateway")
    os.chmod(pki.ca_folder(certs), 0o755)
    assert any("ca is open to others" in r for r in pki.check_layout(certs)[0])
    # the public key set is public: nobody minds who reads it
    os.chmod(certs / pki.TOKEN_PUBLIC_KEYS_FILE, 0o644)
    assert isinstance(Trust.from_config(cfg, ident.CHAT).verifier, tokens.Verifier)
