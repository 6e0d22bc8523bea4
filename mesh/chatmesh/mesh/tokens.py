"""Owner tokens: short-lived, signed statements "this call acts for owner O (in conversation C)".

The gateway mints one after it has authenticated a user (and the token-issuing RPC mints one for an internal
service allowed to act for users); it travels in the gRPC metadata key `chatmesh-owner-token`; chat verifies it
and forwards it on every owner-scoped call; the store and the engine accept an owner-scoped call only with a
valid token for the request's owner (`owner_guard.py`). So a service with a valid certificate still cannot read,
charge or delete a user's data unless that user is behind the call.

Format: a JWS in compact serialization (RFC 7515), `header.payload.signature`, base64url without padding:
header `{"alg": "EdDSA", "kid": <key id>, "typ": "chatmesh-owner"}`, payload
`{"sub": <owner id>, "azp": <the identity it was minted for>, "cnv": <conversation id, when bound to one>,
"scp": [<scopes>, when limited], "pta": <prompt tokens a turn may use, when limited>, "iat": <unix s>,
"exp": <unix s>}`, signed with Ed25519. Any JOSE library can decode one; only `alg` EdDSA is accepted (no
algorithm confusion), `kid` picks the verification key.

What a verifier refuses, besides a bad signature or an unknown key:
- a lifetime (`exp - iat`) over the configured TTL (CHATMESH_OWNER_TOKEN_TTL_S, every process reads it), so a
  stolen signing key cannot mint a token that outlives the key's retirement; `iat` more than `CLOCK_SKEW_S` in
  the future, `exp` more than `CLOCK_SKEW_S` past;
- a token of a key no longer in the key set, even one already verified and cached (a retired key is retired at
  once, not when the cache forgets it);
- (owner_guard.py) a token presented by anyone but its `azp` (the authorized party it was minted for, as in
  OpenID Connect: the sender constraint of RFC 8705, by identity rather than by certificate thumbprint, so a
  token survives its presenter's certificate rotation) or a mesh service that forwards a request's token
  (`FORWARDERS`: chat, to the store, the engine and a peer chat process; an engine, to the engine it pulls a
  prefix from). A token minted for client/dev and replayed by the gateway's identity, or the
  gateway's token replayed by client/dev, is refused.

Scopes (`scp`, set on the tokens OwnerTokenService issues to internal clients, from their grant): which
ChatService RPCs the token opens, by scope name (`SCOPES`) or RPC name. A token without `scp` (the gateway's own,
for the user it authenticated) opens every RPC. Checked where the token enters the mesh (chat), by the guard.

Keys: a JSON key set, `{"signing_key_id": "...", "keys": {"<kid>": {"public": "<b64url>", "private": "<b64url>"}}}`.
Only the issuer (the gateway) holds private halves; verifiers hold a copy without them (`to_json(private=False)`),
so a verifier cannot mint. Rotation: add a key and make it the signer (`KeySet.rotated`, `chatmesh certs
--rotate-token-key`); the old key stays to verify tokens already out until they expire (the TTL), then is
retired. Both files are watched (`reload.Watched`), and a verifier meeting an unknown key id re-reads its file at
once, so a rotation needs no restart anywhere.

Cost: an Ed25519 verification is ~60 us here; one turn presents the same token to chat, the store (several calls)
and the engine, so each verifier caches what it verified (by the token's bytes, expiry rechecked every time).
"""

from __future__ import annotations

import base64
import contextvars
import json
import os
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from chatmesh.mesh import identity as ident
from chatmesh.mesh.errors import Unauthenticated
from chatmesh.mesh.identity import Identity
from chatmesh.mesh.ids import ConversationId, OwnerId
from chatmesh.mesh.reload import Watched

METADATA_KEY = "chatmesh-owner-token"
KEYS_FILE, PUBLIC_KEYS_FILE = "owner-token-keys.json", "owner-token-public-keys.json"  # <data>/gateway/, <data>/certs/
TYP = "chatmesh-owner"
CLOCK_SKEW_S = 5  # how far a verifier's clock may be from the gateway's: iat in the future, exp in the past
MAX_TOKEN_BYTES = 2048
CACHE_ENTRIES = 8192
# Identities that present tokens minted for others, forwarding the token a request arrived with: chat, to the
# store, the engine and the peer chat process generating a turn (StopTurn); the engine, to the replica it pulls a
# turn's cached prefix from (PullPrefix, the only RPC of another service an engine may call). Every other
# presenter must be the token's `azp`.
FORWARDERS: tuple[Identity, ...] = (ident.CHAT, ident.ENGINE)
# Scopes of the tokens internal clients get (their grant names them): the ChatService RPCs each opens.
SCOPES: dict[str, frozenset[str]] = {
    "read": frozenset({"GetConversation", "ListConversations", "GetUsage", "ExportUserData", "GetTurn",
                       "AttachTurn"}),
    "turns": frozenset({"CreateConversation", "SendTurn", "RegenerateTurn", "StopTurn", "AttachTurn", "GetTurn",
                        "CompactConversation"}),
    "delete": frozenset({"DeleteConversation", "DeleteTurn"}),
}


class TokenRefused(Unauthenticated):
    """The owner token is missing, malformed, expired, signed by an unknown key or not signed by its key."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError):
        raise TokenRefused("owner token is malformed (bad base64)") from None


@dataclass(frozen=True)
class SigningKey:
    public: Ed25519PublicKey
    private: Ed25519PrivateKey | None


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _raw_private(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def new_key_id() -> str:
    return f"{time.strftime('%Y%m%d', time.gmtime())}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class KeySet:
    signing_key_id: str
    keys: Mapping[str, SigningKey]

    @classmethod
    def generate(cls) -> KeySet:
        kid = new_key_id()
        private = Ed25519PrivateKey.generate()
        return cls(kid, {kid: SigningKey(private.public_key(), private)})

    def rotated(self) -> KeySet:
        kid = new_key_id()
        while kid in self.keys:
            kid = new_key_id()
        private = Ed25519PrivateKey.generate()
        return KeySet(kid, {**self.keys, kid: SigningKey(private.public_key(), private)})

    def without(self, retire: Iterable[str]) -> KeySet:
        gone = set(retire)
        if self.signing_key_id in gone:
            raise ValueError(f"cannot retire the signing key {self.signing_key_id}")
        return KeySet(self.signing_key_id, {k: v for k, v in self.keys.items() if k not in gone})

    def to_json(self, private: bool) -> bytes:
        keys: dict[str, dict[str, str]] = {}
        for kid, key in self.keys.items():
            keys[kid] = {"public": _b64(_raw_public(key.public))}
            if private and key.private is not None:
                keys[kid]["private"] = _b64(_raw_private(key.private))
        return json.dumps({"signing_key_id": self.signing_key_id, "keys": keys}, indent=2).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, source: str = "owner token keys") -> KeySet:
        try:
            doc = json.loads(data)
            kid = doc["signing_key_id"]
            keys = {k: SigningKey(Ed25519PublicKey.from_public_bytes(_unb64(v["public"])),
                                  Ed25519PrivateKey.from_private_bytes(_unb64(v["private"])) if "private" in v
                                  else None)
                    for k, v in doc["keys"].items()}
        except (KeyError, TypeError, AttributeError, ValueError, TokenRefused) as err:
            raise ValueError(f"{source}: expected {{\"signing_key_id\", \"keys\": {{id: {{\"public\", "
                             f"\"private\"?}}}}}} with base64url Ed25519 keys ({type(err).__name__}: {err})") from None
        if kid not in keys:
            raise ValueError(f"{source}: signing_key_id {kid!r} is not among the keys")
        for k, key in keys.items():
            if key.private is not None and _raw_public(key.private.public_key()) != _raw_public(key.public):
                raise ValueError(f"{source}: key {k!r}: the private key does not match the public key")
        return cls(kid, keys)


def watch_keys(path: Path) -> Watched[KeySet]:
    return Watched([path], lambda data: KeySet.from_json(data[0], str(path)))


@dataclass(frozen=True)
class OwnerClaims:
    """What a verified token says: the owner, the conversation it is bound to (None: every conversation of the
    owner), its expiry (unix seconds), the key id that signed it, the identity it was minted for (`presenter`),
    the scopes it is limited to (None: every RPC) and the prompt tokens a turn may use (None: the request's own
    allowance)."""

    owner: OwnerId
    conversation: ConversationId | None
    expires_at: int
    key_id: str
    presenter: Identity
    scopes: tuple[str, ...] | None = None
    prompt_allowance: int | None = None

    def opens(self, rpc: str) -> bool:
        """Whether the token's scopes include ChatService RPC `rpc` (its name, e.g. "SendTurn")."""
        return self.scopes is None or any(s == rpc or rpc in SCOPES.get(s, ()) for s in self.scopes)


def known_scope(scope: str) -> bool:
    """A scope name of `SCOPES`, or the name of an RPC one of them opens."""
    return scope in SCOPES or any(scope in rpcs for rpcs in SCOPES.values())


@dataclass(frozen=True)
class Minted:
    token: str
    claims: OwnerClaims


class Issuer:
    """Mints owner tokens with the key set's signing key (the gateway, the token-issuing RPC)."""

    def __init__(self, keys: Watched[KeySet], ttl_s: int) -> None:
        if ttl_s <= 0:
            raise ValueError("CHATMESH_OWNER_TOKEN_TTL_S must be positive")
        self.keys = keys
        self.ttl_s = ttl_s
        signer = keys.current().keys[keys.current().signing_key_id]
        if signer.private is None:
            raise ValueError(f"{keys.paths[0]}: the signing key has no private half (this is a verifier's copy; "
                             f"the issuer needs the file with private keys)")

    def mint(self, owner: OwnerId, conversation: ConversationId | None = None, ttl_s: int | None = None,
             now: float | None = None, *, presenter: Identity, scopes: tuple[str, ...] | None = None,
             prompt_allowance: int | None = None) -> Minted:
        """A token for `owner` (in `conversation`) that only `presenter` (and the forwarders) may present."""
        keys = self.keys.current()
        private = keys.keys[keys.signing_key_id].private
        if private is None:
            raise ValueError("the signing key has no private half")
        issued = int(time.time() if now is None else now)
        life = self.ttl_s if ttl_s is None else max(1, min(ttl_s, self.ttl_s))
        header = {"alg": "EdDSA", "kid": keys.signing_key_id, "typ": TYP}
        payload: dict[str, object] = {"sub": owner, "azp": presenter, "iat": issued, "exp": issued + life}
        if conversation is not None:
            payload["cnv"] = conversation
        if scopes is not None:
            payload["scp"] = list(scopes)
        if prompt_allowance is not None:
            payload["pta"] = prompt_allowance
        signing_input = f"{_b64(json.dumps(header, separators=(',', ':')).encode())}." \
                        f"{_b64(json.dumps(payload, separators=(',', ':')).encode())}"
        token = f"{signing_input}.{_b64(private.sign(signing_input.encode()))}"
        return Minted(token, OwnerClaims(owner, conversation, issued + life, keys.signing_key_id, presenter,
                                         scopes, prompt_allowance))


@dataclass
class Verifier:
    """Checks owner tokens against the key set's public keys (chat, store, engine), and that none lives longer
    than `max_ttl_s` (CHATMESH_OWNER_TOKEN_TTL_S)."""

    keys: Watched[KeySet]
    max_ttl_s: int = 900
    _cache: dict[str, OwnerClaims] = field(default_factory=dict)

    def verify(self, token: str, now: float | None = None) -> OwnerClaims:
        at = time.time() if now is None else now
        claims = self._cache.get(token)
        if claims is None:
            claims = self._verify_signature(token, at)
            if len(self._cache) >= CACHE_ENTRIES:
                self._cache.clear()
            self._cache[token] = claims
        elif claims.key_id not in self.keys.current().keys:  # retired since it was cached
            self._cache.pop(token, None)
            raise TokenRefused(f"owner token is signed by a retired key ({claims.key_id[:40]!r})")
        if at > claims.expires_at + CLOCK_SKEW_S:
            raise TokenRefused(f"owner token expired {int(at - claims.expires_at)} s ago")
        return claims

    def _verify_signature(self, token: str, at: float) -> OwnerClaims:
        if len(token) > MAX_TOKEN_BYTES:
            raise TokenRefused("owner token is malformed (too long)")
        parts = token.split(".")
        if len(parts) != 3:
            raise TokenRefused("owner token is malformed (expected header.payload.signature)")
        try:
            header = json.loads(_unb64(parts[0]))
            payload = json.loads(_unb64(parts[1]))
        except ValueError:
            raise TokenRefused("owner token is malformed (bad JSON)") from None
        if not isinstance(header, dict) or header.get("alg") != "EdDSA" or header.get("typ") != TYP:
            raise TokenRefused("owner token is malformed (not an EdDSA chatmesh-owner token)")
        kid = header.get("kid")
        keys = self.keys.current()
        if kid not in keys.keys:
            keys = self.keys.current(force=True)  # a rotation may have reached the gateway first
        key = keys.keys.get(kid) if isinstance(kid, str) else None
        if key is None:
            raise TokenRefused(f"owner token is signed by an unknown key ({str(kid)[:40]!r})")
        try:
            key.public.verify(_unb64(parts[2]), f"{parts[0]}.{parts[1]}".encode())
        except InvalidSignature:
            raise TokenRefused("owner token signature does not verify") from None
        try:
            owner, presenter, expires, issued = payload["sub"], payload["azp"], payload["exp"], payload["iat"]
            conversation, scopes, allowance = payload.get("cnv"), payload.get("scp"), payload.get("pta")
        except (KeyError, TypeError):
            raise TokenRefused("owner token is malformed (missing sub, azp, iat or exp)") from None
        if not isinstance(owner, str) or not isinstance(presenter, str) or not isinstance(expires, int) \
                or not isinstance(issued, int) or not (conversation is None or isinstance(conversation, str)) \
                or not (scopes is None or (isinstance(scopes, list) and all(isinstance(x, str) for x in scopes))) \
                or not (allowance is None or (isinstance(allowance, int) and allowance > 0)):
            raise TokenRefused("owner token is malformed (wrong claim types)")
        if issued > at + CLOCK_SKEW_S:
            raise TokenRefused("owner token is issued in the future (clock skew?)")
        if expires - issued > self.max_ttl_s:
            raise TokenRefused(f"owner token lives {expires - issued} s, longer than CHATMESH_OWNER_TOKEN_TTL_S "
                               f"({self.max_ttl_s} s)")
        return OwnerClaims(OwnerId(owner), ConversationId(conversation) if conversation else None, expires, str(kid),
                           Identity(presenter), tuple(scopes) if scopes is not None else None, allowance)


# ---- carrying a token through one request ------------------------------------------------------------------

# The token the current request arrived with: a servicer that acts for the owner (chat) sets it, and the clients
# of the services it calls add it to their calls' metadata, so the core in between never handles credentials.
# Tasks started while serving the request inherit it (asyncio copies the context at task creation).
current: contextvars.ContextVar[str | None] = contextvars.ContextVar("chatmesh_owner_token", default=None)


def metadata_of(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((METADATA_KEY, token),) if token else ()


def forwarded() -> tuple[tuple[str, str], ...]:
    """Metadata carrying the current request's token (empty outside one)."""
    return metadata_of(current.get())


def from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return value if isinstance(value, str) else value.decode()
    return None


def keys_file(explicit: str, data_dir: str, issuer: bool) -> Path:
    """CHATMESH_OWNER_TOKEN_KEYS_FILE, or the development files (pki.py): the private keys in <data dir>/gateway/
    for the issuer (the gateway), the public-only copy in <data dir>/certs/ for verifiers."""
    if explicit:
        return Path(explicit).expanduser()
    data = Path(os.path.expanduser(data_dir))
    return data / "gateway" / KEYS_FILE if issuer else data / "certs" / PUBLIC_KEYS_FILE
