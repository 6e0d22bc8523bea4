"""The conversation store's tables (SQLAlchemy 2 declarative models).

Partitioned by owner: every primary key leads with `owner_id` and every query the core issues filters on it,
so the schema distributes unchanged on Citus with `owner_id` as the distribution column (child tables
reference their conversation through (owner_id, conversation_id), which keeps them co-located).
Times are Unix epoch milliseconds (BIGINT) so both backends store them the same way.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, ForeignKeyConstraint, Integer, MetaData, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

ID = String(36)  # a canonical UUID
OWNER = String(128)  # chatmesh.mesh.ids.MAX_OWNER_ID_BYTES

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class ConversationRow(Base):
    """A conversation, its rolling summary, and the next message index (`message_count`)."""

    __tablename__ = "conversations"

    owner_id: Mapped[str] = mapped_column(OWNER, primary_key=True)
    conversation_id: Mapped[str] = mapped_column(ID, primary_key=True)
    title: Mapped[str] = mapped_column(String(200), default="")
    system_prompt_version: Mapped[str] = mapped_column(String(64), default="")
    created_at_ms: Mapped[int] = mapped_column(BigInteger)
    updated_at_ms: Mapped[int] = mapped_column(BigInteger, index=True)
    message_count: Mapped[int] = mapped_column(Integer, default=0)
    summary_text: Mapped[str | None] = mapped_column(Text, nullable=True)
    summary_covers_through: Mapped[int] = mapped_column(Integer, default=-1)
    summary_token_count: Mapped[int] = mapped_column(Integer, default=0)
    summary_created_at_ms: Mapped[int] = mapped_column(BigInteger, default=0)


class MessageRow(Base):
    """One stored message. `superseded` marks a reply replaced by a regenerated one (kept as an alternative)."""

    __tablename__ = "messages"
    __table_args__ = (
        ForeignKeyConstraint(["owner_id", "conversation_id"],
                             ["conversations.owner_id", "conversations.conversation_id"], ondelete="CASCADE"),
    )

    owner_id: Mapped[str] = mapped_column(OWNER, primary_key=True)
    conversation_id: Mapped[str] = mapped_column(ID, primary_key=True)
    message_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str] = mapped_column(Text)
    token_count: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    turn_id: Mapped[str] = mapped_column(ID)
    created_at_ms: Mapped[int] = mapped_column(BigInteger)
    superseded: Mapped[bool] = mapped_column(Boolean, default=False)
    parts: Mapped[str | None] = mapped_column(Text, nullable=True)  # rows.parts_json: tool calls or results


class TurnRow(Base):
    """The idempotency record and state machine of one turn id (invariant I2).

    `content` holds the user's message only while the turn is unfinished; it moves into `messages` when the
    turn is stored and is cleared when it fails. `partial_text` is the reply so far, for attaching, and what an
    attempt that failed or lapsed showed, for the next claim to continue. `generation_options` is the turn's
    options as its first claim sent them (the caller's JSON, not read here), for every later claim; cleared when
    the turn is stored. `input_parts` holds a tool turn's results (its input is a tool message, not a user
    message) while it is unfinished, like `content`.
    """

    __tablename__ = "turns"
    __table_args__ = (
        ForeignKeyConstraint(["owner_id", "conversation_id"],
                             ["conversations.owner_id", "conversations.conversation_id"], ondelete="CASCADE"),
    )

    owner_id: Mapped[str] = mapped_column(OWNER, primary_key=True)
    conversation_id: Mapped[str] = mapped_column(ID, primary_key=True)
    turn_id: Mapped[str] = mapped_column(ID, primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(128))
    state: Mapped[str] = mapped_column(String(16))
    content: Mapped[str | None] = mapped_column(Text, nullable=True)
    lease_id: Mapped[str | None] = mapped_column(ID, nullable=True)
    lease_holder: Mapped[str] = mapped_column(String(128), default="")
    lease_expires_at_ms: Mapped[int] = mapped_column(BigInteger, default=0)
    regenerates_turn_id: Mapped[str | None] = mapped_column(ID, nullable=True)
    user_index: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reply_index: Mapped[int | None] = mapped_column(Integer, nullable=True)
    partial_text: Mapped[str] = mapped_column(Text, default="")
    event_sequence: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at_ms: Mapped[int] = mapped_column(BigInteger)
    updated_at_ms: Mapped[int] = mapped_column(BigInteger, index=True)
    generation_options: Mapped[str] = mapped_column(Text, default="", server_default="")
    input_parts: Mapped[str | None] = mapped_column(Text, nullable=True)  # a tool turn's results, until stored


class UsageRow(Base):
    """Token counts per owner per UTC day. Numbers only; survives conversation deletion."""

    __tablename__ = "usage_days"

    owner_id: Mapped[str] = mapped_column(OWNER, primary_key=True)
    day: Mapped[str] = mapped_column(String(10), primary_key=True)  # YYYY-MM-DD
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    turns: Mapped[int] = mapped_column(BigInteger, default=0)


OWNER_TABLES = tuple(Base.metadata.sorted_tables)
