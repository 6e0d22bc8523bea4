"""Owner tokens: what verifies, what is refused (expired, too long-lived, unknown or retired key, tampered, wrong
algorithm), rotation."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from chatmesh.mesh import identity as ident
from chatmesh.mesh import pki, tokens
from chatmesh.mesh.ids import ConversationId, OwnerId
from chatmesh.mesh.tokens import Issuer, KeySet, TokenRefused, Verifier

ALICE, BOB = OwnerId("alice"), OwnerId("bob")
CONV = ConversationId("6c0d3f8e-3f5b-4a53-9d7e-2a4b1c6e9f01")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    pki.ensure(tmp_path / "certs", identities=[])
    return tmp_path / "certs"


class _Issuer(Issuer):
    """The gateway's issuer, minting for itself unless told otherwise."""

    def mint(self, owner: OwnerId, conversation: ConversationId | None = None, ttl_s: int | None = None,
             now: float | None = None, *, presenter: ident.Identity = ident.GATEWAY,
             scopes: tuple[str, ...] | None = None, prompt_allowance: int | None = None) -> tokens.Minted:
        return super().mint(owner, conversation, ttl_s, now, presenter=presenter, scopes=scopes,
                            prompt_allowance=prompt_allowance)


def issuer(folder: Path, ttl_s: int = 60) -> _Issuer:
    return _Issuer(tokens.watch_keys(pki.private_keys_file(folder)), ttl_s)


def verifier(folder: Path, max_ttl_s: int = 60) -> Verifier:
    return Verifier(tokens.watch_keys(folder / pki.TOKEN_PUBLIC_KEYS_FILE), max_ttl_s)


def forge(folder: Path, claims: dict[str, object]) -> str:
    """A token with any claims, signed with the real signing key (what a holder of the gateway's key file can
    make)."""
    keys = KeySet.from_json(pki.private_keys_file(folder).read_bytes())
    private = keys.keys[keys.signing_key_id].private
    assert private is not None
    signing_input = f"{_segment({'alg': 'EdDSA', 'kid': keys.signing_key_id, 'typ': 'chatmesh-owner'})}." \
                    f"{_segment(claims)}"
    return f"{signing_input}.{base64.urlsafe_b64encode(private.sign(signing_input.encode())).rstrip(b'=').decode()}"


def _segment(data: dict[str, object]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def test_a_minted_token_verifies_to_its_owner_conversation_presenter_and_limits(folder: Path) -> None:
    minted = issuer(folder).mint(ALICE, CONV, now=1_000)
    claims = verifier(folder).verify(minted.token, now=1_010)
    assert (claims.owner, claims.conversation, claims.expires_at) == (ALICE, CONV, 1_060)
    assert (claims.presenter, claims.scopes, claims.prompt_allowance) == (ident.GATEWAY, None, None)
    assert claims.opens("ExportUserData")
    client = issuer(folder).mint(ALICE, presenter=ident.client("reports"), scopes=("read",), prompt_allowance=500)
    limited = verifier(folder).verify(client.token)
    assert (limited.presenter, limited.scopes, limited.prompt_allowance) == \
        (ident.client("reports"), ("read",), 500) == (client.claims.presenter, client.claims.scopes, 500)
    assert limited.opens("ExportUserData") and not limited.opens("SendTurn") and not limited.opens("DeleteTurn")
    header = json.loads(base64.urlsafe_b64decode(minted.token.split(".")[0] + "=="))
    assert header == {"alg": "EdDSA", "kid": claims.key_id, "typ": "chatmesh-owner"}


def test_expired_tokens_are_refused_after_seconds_of_skew(folder: Path) -> None:
    assert tokens.CLOCK_SKEW_S <= 5
    minted = issuer(folder, ttl_s=60).mint(ALICE, now=1_000)
    v = verifier(folder)
    assert v.verify(minted.token, now=1_060 + tokens.CLOCK_SKEW_S).owner == ALICE
    with pytest.raises(TokenRefused, match="expired"):
        v.verify(minted.token, now=1_061 + tokens.CLOCK_SKEW_S)  # also from the cache of verified tokens


def test_a_token_living_longer_than_the_configured_ttl_is_refused_though_signed_with_the_real_key(
        folder: Path) -> None:
    """The finding: with the signing key, a token that expires in 100 years verified everywhere."""
    now = 1_700_000_000
    century = forge(folder, {"sub": "bob", "azp": ident.GATEWAY, "iat": now, "exp": now + 100 * 365 * 86400})
    with pytest.raises(TokenRefused, match="longer than CHATMESH_OWNER_TOKEN_TTL_S"):
        verifier(folder, max_ttl_s=900).verify(century, now=now + 1)
    at_the_cap = forge(folder, {"sub": "bob", "azp": ident.GATEWAY, "iat": now, "exp": now + 900})
    assert verifier(folder, max_ttl_s=900).verify(at_the_cap, now=now + 1).owner == BOB
    backdated = forge(folder, {"sub": "bob", "azp": ident.GATEWAY, "iat": now + 60, "exp": now + 900})
    with pytest.raises(TokenRefused, match="in the future"):
        verifier(folder, max_ttl_s=900).verify(backdated, now=now)
    no_presenter = forge(folder, {"sub": "bob", "iat": now, "exp": now + 60})
    with pytest.raises(TokenRefused, match="missing sub, azp"):
        verifier(folder).verify(no_presenter, now=now)


def test_a_tampered_owner_does_not_verify(folder: Path) -> None:
    header, payload, signature = issuer(folder).mint(ALICE).token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=="))
    forged = f"{header}.{_segment({**claims, 'sub': 'bob'})}.{signature}"
    with pytest.raises(TokenRefused, match="signature does not verify"):
        verifier(folder).verify(forged)


def test_a_token_of_an_unknown_key_or_another_algorithm_is_refused(folder: Path, tmp_path_factory: pytest.TempPathFactory
                                                                  ) -> None:
    other = tmp_path_factory.mktemp("other") / "certs"
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
    old_kid = KeySet.from_json(pki.private_keys_file(folder).read_bytes()).signing_key_id
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


def test_a_retired_keys_token_is_refused_even_from_the_cache(folder: Path) -> None:
    """The finding: the cache of verified tokens answered without looking at the key, so a retired (leaked) key's
    tokens stayed good until they expired or the cache forgot them."""
    v = verifier(folder)
    old = issuer(folder).mint(ALICE).token
    assert v.verify(old).owner == ALICE  # now cached
    old_kid = KeySet.from_json(pki.private_keys_file(folder).read_bytes()).signing_key_id
    pki.rotate_token_key(folder, retire=[old_kid])
    v.keys.current(force=True)  # the verifier's next look at its file (at most a second later)
    with pytest.raises(TokenRefused, match="retired key"):
        v.verify(old)
    with pytest.raises(TokenRefused, match="unknown key"):
        v.verify(old)  # dropped from the cache: the signature path refuses it too


def test_verifiers_hold_no_private_keys_and_cannot_mint(folder: Path) -> None:
    public = json.loads((folder / pki.TOKEN_PUBLIC_KEYS_FILE).read_text())
    assert all(set(k) == {"public"} for k in public["keys"].values())
    with pytest.raises(ValueError, match="no private half"):
        Issuer(tokens.watch_keys(folder / pki.TOKEN_PUBLIC_KEYS_FILE), 60)
