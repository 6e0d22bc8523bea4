"""Owner-token grants: which owners an internal client may act for, and how (the gateway's OwnerTokenService mints
only what a grant allows; OAuth's token exchange, RFC 8693, asks the same of a delegation).

A grant is per client identity, in the authorization file (CHATMESH_MESH_AUTHZ_FILE) under "owner_token_grants";
without one a client gets no token at all (default nothing):

    {"owner_token_grants": {
       "spiffe://chatmesh/client/reports": {"owners": "all", "scopes": ["read"]},
       "spiffe://chatmesh/client/bot": {"owners": ["alice", "4c1f...-user-id"], "scopes": ["read", "turns"],
                                        "prompt_tokens_per_turn": 4000},
       "spiffe://chatmesh/client/support": {"owners": {"group": "support"}, "scopes": ["turns"],
                                            "prompt_tokens_per_turn": 2000}}}

- owners: "all" (every user the gateway knows), "none", a list of user names or owner ids, or {"group": NAME}
  (the users the gateway's accounts put in that group: `chatmesh groups add NAME USER`). An owner the gateway does
  not know is never granted, whatever the grant says.
- scopes: what the tokens open at ChatService (tokens.SCOPES: "read" for reads and export, "turns" to create
  conversations and send, regenerate, stop and follow turns, "delete"; or single RPC names). Required, not empty.
- prompt_tokens_per_turn: the most prompt tokens one turn of the client's may use (the token's `pta`; chat refuses
  a larger prompt before any engine work, as it refuses one over the edge's allowance). Required when the scopes
  send turns: an internal client's turns carry a budget from its grant, never none.

The gateway re-reads the grants within a second of the file changing (`reload.Watched`; a change that does not
parse keeps the grants in force and is logged), so a grant revoked or narrowed mints nothing more without a
restart; tokens already minted live out their lifetime (CHATMESH_OWNER_TOKEN_TTL_S, 900 s by default).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from chatmesh.mesh import identity as ident
from chatmesh.mesh import tokens
from chatmesh.mesh.identity import Identity

KEY = "owner_token_grants"
TURN_RPCS = frozenset({"SendTurn", "RegenerateTurn"})  # the RPCs that spend prompt tokens


class Owners(enum.Enum):
    ALL = "all"
    NONE = "none"
    LISTED = "listed"
    GROUP = "group"


@dataclass(frozen=True)
class Grant:
    owners: Owners
    scopes: tuple[str, ...]
    listed: frozenset[str] = frozenset()  # Owners.LISTED: user names or owner ids
    group: str = ""  # Owners.GROUP
    prompt_tokens_per_turn: int | None = None

    @property
    def sends_turns(self) -> bool:
        return any(s in TURN_RPCS or bool(TURN_RPCS & tokens.SCOPES.get(s, frozenset())) for s in self.scopes)


def _owners(value: object, where: str) -> tuple[Owners, frozenset[str], str]:
    if value in ("all", "none"):
        return Owners(value), frozenset(), ""
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return Owners.LISTED, frozenset(value), ""
    if isinstance(value, dict) and set(value) == {"group"} and isinstance(value["group"], str) and value["group"]:
        return Owners.GROUP, frozenset(), value["group"]
    raise ValueError(f"{where}.owners: expected \"all\", \"none\", a non-empty list of user names or ids, or "
                     f"{{\"group\": NAME}}")


def parse_grant(who: str, doc: object) -> Grant:
    where = f"{KEY}[{who!r}]"
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected an object")
    unknown = sorted(set(doc) - {"owners", "scopes", "prompt_tokens_per_turn"})
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}")
    owners, listed, group = _owners(doc.get("owners"), where)
    scopes = doc.get("scopes")
    if not isinstance(scopes, list) or not scopes or not all(isinstance(s, str) for s in scopes):
        raise ValueError(f"{where}.scopes: expected a non-empty list of scopes ({', '.join(tokens.SCOPES)}) or RPC "
                         f"names")
    bad = [s for s in scopes if not tokens.known_scope(s)]
    if bad:
        raise ValueError(f"{where}.scopes: unknown {bad} (scopes: {', '.join(tokens.SCOPES)}, or ChatService RPC "
                         f"names they open)")
    budget = doc.get("prompt_tokens_per_turn")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0):
        raise ValueError(f"{where}.prompt_tokens_per_turn: expected a positive integer")
    grant = Grant(owners, tuple(scopes), listed, group, budget)
    if grant.sends_turns and budget is None:
        raise ValueError(f"{where}: scopes {scopes} send turns, so prompt_tokens_per_turn is required (the most "
                         f"prompt tokens one of its turns may use)")
    return grant


def parse(doc: Mapping[str, object]) -> dict[Identity, Grant]:
    """The grants of an authorization file's parsed JSON (its other keys are authorization rules)."""
    section = doc.get(KEY, {})
    if not isinstance(section, dict):
        raise ValueError(f"{KEY}: expected {{\"spiffe://chatmesh/client/NAME\": {{...}}}}")
    out: dict[Identity, Grant] = {}
    for who, grant in section.items():
        identity = ident.parse(str(who))
        if not identity.startswith(ident.PREFIX + "client/"):
            raise ValueError(f"{KEY}: {who} is not a client identity (spiffe://chatmesh/client/NAME): only internal "
                             f"clients are granted owner tokens")
        out[identity] = parse_grant(str(who), grant)
    return out
