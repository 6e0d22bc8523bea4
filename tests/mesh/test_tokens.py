"""Owner tokens: what verifies, what is refused (expired, unknown key, tampered, wrong algorithm), rotation."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from chatmesh.mesh import pki, tokens
from chatmesh.mesh.ids import ConversationId, OwnerId
from chatmesh.mesh.tokens import Issuer, KeySet, TokenRefused, Verifier

ALICE, BOB = OwnerId("alice"), OwnerId("bob")
CONV = ConversationId("6c0d3f8e-3f5b-4a53-9d7e-2a4b1c6e9f01")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    pki.ensure(tmp_path, identities=[])
    return tmp_path


def issuer(folder: Path, ttl_s: int = 60) -> Issuer:
    return Issuer(tokens.watch_keys(folder / pki.TOKEN_KEYS_FILE), ttl_s)


def verifier(folder: Path) -> Verifier:
    return Verifier(tokens.watch_keys(folder / pki.TOKEN_PUBLIC_KEYS_FILE))


def _segment(data: dict[str, object]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def test_a_minted_token_verifies_to_its_owner_and_conversation(folder: Path) -> None:
    minted = issuer(folder).mint(ALICE, CONV, now=1_000)
    claims = verifier(folder).verify(minted.token, now=1_010)
    assert (claims.owner, claims.conversation, claims.expires_at) == (ALICE, CONV, 1_060)
    header = json.loads(base64.urlsafe_b64decode(minted.token.split(".")[0] + "=="))
    assert header == {"alg": "EdDSA", "kid": claims.key_id, "typ": "chatmesh-owner"}


def test_expired_tokens_are_refused(folder: Path) -> None:
    minted = issuer(folder, ttl_s=60).mint(ALICE, now=1_000)
    v = verifier(folder)
    assert v.verify(minted.token, now=1_060 + tokens.CLOCK_SKEW_S).owner == ALICE
    with pytest.raises(TokenRefused, match="expired"):
        v.verify(minted.token, now=1_061 + tokens.CLOCK_SKEW_S)  # also from the cache of verified tokens


def test_a_tampered_owner_does_not_verify(folder: Path) -> None:
    header, payload, signature = issuer(folder).mint(ALICE).token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=="))
    forged = f"{header}.{_segment({**claims, 'sub': 'bob'})}.{signature}"
    with pytest.raises(TokenRefused, match="signature does not verify"):
        verifier(folder).verify(forged)


def test_a_token_of_an_unknown_key_or_another_algorithm_is_refused(folder: Path, tmp_path_factory: pytest.TempPathFactory
                                                                  ) -> None:
    other = tmp_path_factory.mktemp("other")
    pki.ensure(other, identities=[])
    with pytest.raises(TokenRefused, match="unknown key"):
        verifier(folder).verify(issuer(other).mint(ALICE).token)
    _, payload, _ = issuer(folder).mint(ALICE).token.split(".")
    with pytest.raises(TokenRefused, match="not an EdDSA"):
        verifier(folder).verify(f"{_segment({'alg': 'none', 'typ': 'chatmesh-owner'})}.{payload}.")
    with pytest.raises(TokenRefused, match="malformed"):
        verifier(folder).verify("not-a-token")


def test_rotation_keeps_old_tokens_valid_until_their_key_is_retired(folder: Path) -> None:
    v, old_issuer = verifier(folder), issuer(folder)
    old = old_issuer.mint(ALICE).token
    old_kid = KeySet.from_json((folder / pki.TOKEN_KEYS_FILE).read_bytes()).signing_key_id
    new_kid = pki.rotate_token_key(folder)
    new = issuer(folder).mint(BOB)
    assert new.claims.key_id == new_kid != old_kid
    # the running verifier has not re-read its file yet (checks at most once a second), but an unknown key id
    # makes it look at once
    assert v.verify(new.token).owner == BOB
    assert v.verify(old).owner == ALICE
    pki.retire_token_keys(folder, [old_kid])
    with pytest.raises(TokenRefused, match="unknown key"):
        verifier(folder).verify(old)


def test_verifiers_hold_no_private_keys_and_cannot_mint(folder: Path) -> None:
    public = json.loads((folder / pki.TOKEN_PUBLIC_KEYS_FILE).read_text())
    assert all(set(k) == {"public"} for k in public["keys"].values())
    with pytest.raises(ValueError, match="no private half"):
        Issuer(tokens.watch_keys(folder / pki.TOKEN_PUBLIC_KEYS_FILE), 60)
