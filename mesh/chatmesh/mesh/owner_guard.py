"""The one owner check a servicer makes before it touches an owner's data: `OwnerGuard.owner(...)`.

An owner-scoped request names its owner in a field (`owner_id`); the field is believed only when the call carries
an owner token (tokens.py) that verifies and is for that owner, and, if the token is bound to a conversation,
for that conversation, named by the call (a bound token opens no call that names none; owner-wide calls, such
as export or delete-everything, need an owner-wide token). The token must also be presented by the identity it
was minted for (`azp`), or by a forwarder (`tokens.FORWARDERS`: chat or an engine, passing on its request's token); and
where it enters the mesh, the RPC must be among its scopes. The guard raises typed core errors, which the
bootstrap's one mapping turns into status codes: no token, or one that is expired, tampered with or signed by
an unknown or retired key -> Unauthenticated; a valid token for another owner, conversation, presenter or RPC
-> PermissionDenied. Each refusal is logged once, with the caller's identity, the RPC and ids.

It also keeps the verified token as the request's `tokens.current`, so a service calling on for the owner (chat)
forwards it without handling it. In plaintext (no verifier) the field is believed: the mesh's trust is off.
"""

from __future__ import annotations

from typing import Any, Protocol

from chatmesh.mesh import authz, logs, tokens
from chatmesh.mesh.errors import InvalidArgument, PermissionDenied
from chatmesh.mesh.ids import ConversationId, OwnerId, parse_conversation_id, parse_owner_id
from chatmesh.mesh.tokens import OwnerClaims, TokenRefused, Verifier

log = logs.get("chatmesh.owner_guard")


def _who() -> tuple[str, str]:
    c = authz.caller.get()
    return (c.identity, c.method) if c is not None else ("", "")


class OwnerScoped(Protocol):
    """A request that acts for the owner it names."""

    @property
    def owner_id(self) -> str: ...


class ConversationScoped(OwnerScoped, Protocol):
    """A request that acts for its owner in one conversation."""

    @property
    def conversation_id(self) -> str: ...


class OwnerGuard:
    def __init__(self, verifier: Verifier | None) -> None:
        self.verifier = verifier

    def owner_wide(self, context: Any, request: OwnerScoped) -> OwnerId:
        """The request's owner, for a call across all of its conversations (an owner-wide token)."""
        return self.owner(context, request.owner_id, owner_wide=True)

    def in_conversation(self, context: Any, request: ConversationScoped) -> tuple[OwnerId, ConversationId]:
        """The request's owner and conversation, once its token allows them."""
        conversation = parse_conversation_id(request.conversation_id)
        return self.owner(context, request.owner_id, conversation), conversation

    def owner(self, context: Any, owner_id: str, conversation: ConversationId | None = None, *,
              owner_wide: bool = False, field: str = "owner_id") -> OwnerId:
        """The request's owner, once its token proves the caller acts for that owner (in `conversation`;
        `owner_wide`: across all of the owner's conversations)."""
        owner = parse_owner_id(owner_id, field)
        if self.verifier is None:
            return owner
        claims = self.claims(context)
        if claims.owner != owner:
            self._refuse("owner_mismatch", owner, conversation)
            raise PermissionDenied(f"the owner token is not for {field} {owner!r}")
        if claims.conversation is not None:
            if owner_wide:
                self._refuse("token_bound_to_conversation", owner, conversation)
                raise PermissionDenied("the owner token is bound to one conversation; this call needs an "
                                       "owner-wide token")
            if conversation is None:
                self._refuse("conversation_missing", owner, None)
                raise PermissionDenied("the owner token is bound to one conversation; this call must name it "
                                       "(conversation_id)")
            if claims.conversation != conversation:
                self._refuse("conversation_mismatch", owner, conversation)
                raise PermissionDenied(f"the owner token is not for conversation {conversation}")
        return owner

    def prompt_allowance(self, context: Any, requested: int) -> int:
        """The most prompt tokens this call's turn may use (0: no limit): the request's `prompt_token_allowance`
        (what the edge reserved), and, when the token carries a budget (an internal client's, from its grant), that
        too, whichever is smaller. A client cannot lift its grant's budget by asking for more, or for none."""
        if requested < 0:
            raise InvalidArgument("prompt_token_allowance must not be negative (0: no limit)")
        if self.verifier is None:
            return requested
        granted = self.claims(context).prompt_allowance
        if granted is None:
            return requested
        return min(requested, granted) if requested else granted

    def claims(self, context: Any) -> OwnerClaims:
        """The verified token of this call (Unauthenticated without a valid one), presented by the identity it
        was minted for or a forwarder, and (presented by the former) opening this RPC; else PermissionDenied."""
        assert self.verifier is not None
        token = tokens.from_metadata(context.invocation_metadata())
        if token is None:
            self._refuse("no_token", None, None)
            raise TokenRefused(f"this call acts for an owner and needs an owner token (metadata "
                               f"{tokens.METADATA_KEY})")
        try:
            claims = self.verifier.verify(token)
        except TokenRefused as err:
            self._refuse("token_refused", None, None, str(err))
            raise
        presenter = authz.caller.get()
        if presenter is None or (presenter.identity != claims.presenter and presenter.identity not in tokens.FORWARDERS):
            self._refuse("wrong_presenter", claims.owner, None, f"minted for {claims.presenter}")
            raise PermissionDenied(f"the owner token was minted for {claims.presenter}; "
                                   f"{presenter.identity if presenter else 'this caller'} may not present it")
        if presenter.identity == claims.presenter and not claims.opens(presenter.method.rsplit("/", 1)[-1]):
            self._refuse("out_of_scope", claims.owner, None, f"scopes {','.join(claims.scopes or ())}")
            raise PermissionDenied(f"the owner token's scopes ({', '.join(claims.scopes or ())}) do not open "
                                   f"{presenter.method}")
        tokens.current.set(token)
        return claims

    def _refuse(self, reason: str, owner: OwnerId | None, conversation: ConversationId | None,
                detail: str = "") -> None:
        who, rpc = _who()
        log.warning("owner_denied", reason=reason, caller=who, rpc=rpc, owner_id=owner or "",
                    conversation_id=conversation or "", detail=detail)
