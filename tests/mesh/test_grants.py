"""The authorization file: RPC overrides beside owner-token grants (mesh/grants.py), each read strictly: a
mistake refuses start-up with a message naming it, never a grant wider than written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chatmesh.mesh import authz, grants
from chatmesh.mesh import identity as ident
from chatmesh.mesh.grants import Owners

DEV = "spiffe://chatmesh/client/dev"


def test_grants_parse_owners_scopes_and_budget() -> None:
    parsed = grants.parse({grants.KEY: {
        DEV: {"owners": "all", "scopes": ["read", "turns"], "prompt_tokens_per_turn": 4000},
        "spiffe://chatmesh/client/a": {"owners": ["alice"], "scopes": ["ExportUserData"]},
        "spiffe://chatmesh/client/b": {"owners": {"group": "support"}, "scopes": ["read"]},
        "spiffe://chatmesh/client/c": {"owners": "none", "scopes": ["delete"]}}})
    dev = parsed[ident.client("dev")]
    assert (dev.owners, dev.scopes, dev.prompt_tokens_per_turn, dev.sends_turns) == \
        (Owners.ALL, ("read", "turns"), 4000, True)
    assert parsed[ident.client("a")].listed == frozenset({"alice"}) and not parsed[ident.client("a")].sends_turns
    assert parsed[ident.client("b")].group == "support"
    assert parsed[ident.client("c")].owners is Owners.NONE
    assert grants.parse({}) == {}


@pytest.mark.parametrize(("grant", "message"), [
    ({"owners": "all", "scopes": ["turns"]}, "prompt_tokens_per_turn is required"),
    ({"owners": "all", "scopes": ["SendTurn"], "prompt_tokens_per_turn": 0}, "positive integer"),
    ({"owners": "all", "scopes": []}, "non-empty list"),
    ({"owners": "all", "scopes": ["admin"]}, "unknown ['admin']"),
    ({"owners": "everyone", "scopes": ["read"]}, "owners: expected"),
    ({"owners": [], "scopes": ["read"]}, "owners: expected"),
    ({"owners": "all", "scopes": ["read"], "ttl": 5}, "unknown fields ['ttl']"),
])
def test_a_grant_with_a_mistake_is_refused(grant: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        grants.parse({grants.KEY: {DEV: grant}})


def test_only_client_identities_are_granted() -> None:
    with pytest.raises(ValueError, match="not a client identity"):
        grants.parse({grants.KEY: {"spiffe://chatmesh/gateway": {"owners": "all", "scopes": ["read"]}}})


def test_the_rules_beside_the_grants_are_read_and_anything_else_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "authz.json"
    path.write_text(json.dumps({"/chatmesh.v1.ChatService/ExportUserData": [str(ident.GATEWAY)],
                                grants.KEY: {DEV: {"owners": "all", "scopes": ["read"]}}}))
    assert authz.read_overrides(path) == {"/chatmesh.v1.ChatService/ExportUserData": (ident.GATEWAY,)}
    assert list(grants.parse(authz.read_file(path))) == [ident.client("dev")]
    path.write_text(json.dumps({"grants": {}}))
    with pytest.raises(ValueError, match=r"unknown entries \['grants'\]"):
        authz.read_overrides(path)
