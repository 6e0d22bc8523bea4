"""The rules a turn's write must pass, each written once: as SQL over the placeholders the caller names, so
PostgreSQL's statements (`$n`), SQLite's (`?`) and the SQLAlchemy ones (`:name`, through `text`) all render the
same text, and so does the read that explains a refusal (it selects the rule's value instead of re-deciding it).

- `lease_held`: the turn's record is active (received or running: `chatmesh.mesh.turn.RECORD_ACTIVE`) and its
  lease is the caller's. FinishTurn, FailTurn and UpdateTurnProgress write only while it holds; a finish refused
  by it is explained as "lease not held" (or "already finished", when the record is final).
- `later_user_message`: a user message (or a tool message, a tool turn's input) follows the message at index
  `after`. Only the reply to a
  conversation's last user message can be regenerated, so a regenerate is refused while it holds: when it is
  claimed, and again when it is finished (a turn may have been stored in between).
- `superseded_replies`: the replies a regenerate's finish marks superseded (kept as alternatives): the current
  assistant messages after the user message it answers.
"""

from __future__ import annotations

from chatmesh.mesh.turn import RECORD_ACTIVE

ACTIVE = ", ".join(f"'{state.value}'" for state in RECORD_ACTIVE)


def lease_held(lease: str, turns: str = "turns") -> str:
    """SQL true when the record (table or alias `turns`) is active and holds the lease `lease`."""
    return f"{turns}.lease_id = {lease} AND {turns}.state IN ({ACTIVE})"


def later_user_message(owner: str, conversation: str, after: str) -> str:
    """SQL true when the conversation has a user (or tool) message with an index above `after`."""
    return (f"EXISTS (SELECT 1 FROM messages WHERE messages.owner_id = {owner} "
            f"AND messages.conversation_id = {conversation} AND messages.message_index > {after} "
            "AND messages.role IN ('user', 'tool'))")


def superseded_replies(owner: str, conversation: str, after: str) -> str:
    """SQL selecting (in an UPDATE of `messages`) the current replies after the user message at `after`."""
    return (f"messages.owner_id = {owner} AND messages.conversation_id = {conversation} "
            f"AND messages.message_index > {after} AND messages.role = 'assistant' AND NOT messages.superseded")
