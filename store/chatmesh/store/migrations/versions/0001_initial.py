"""The initial schema: conversations, messages, turns, usage_days, every primary key led by owner_id.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

ID = sa.String(36)
OWNER = sa.String(128)


def _conversation_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(["owner_id", "conversation_id"],
                                   ["conversations.owner_id", "conversations.conversation_id"],
                                   name=f"fk_{table}_conversations", ondelete="CASCADE")


def upgrade() -> None:
    op.create_table(
        "conversations",
        sa.Column("owner_id", OWNER, nullable=False),
        sa.Column("conversation_id", ID, nullable=False),
        sa.Column("title", sa.String(200), nullable=False),
        sa.Column("system_prompt_version", sa.String(64), nullable=False),
        sa.Column("created_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("updated_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("message_count", sa.Integer(), nullable=False),
        sa.Column("summary_text", sa.Text(), nullable=True),
        sa.Column("summary_covers_through", sa.Integer(), nullable=False),
        sa.Column("summary_token_count", sa.Integer(), nullable=False),
        sa.Column("summary_created_at_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("owner_id", "conversation_id", name="pk_conversations"),
    )
    op.create_index("ix_conversations_updated_at_ms", "conversations", ["updated_at_ms"])
    op.create_table(
        "messages",
        sa.Column("owner_id", OWNER, nullable=False),
        sa.Column("conversation_id", ID, nullable=False),
        sa.Column("message_index", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("token_count", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("turn_id", ID, nullable=False),
        sa.Column("created_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("superseded", sa.Boolean(), nullable=False),
        _conversation_fk("messages"),
        sa.PrimaryKeyConstraint("owner_id", "conversation_id", "message_index", name="pk_messages"),
    )
    op.create_table(
        "turns",
        sa.Column("owner_id", OWNER, nullable=False),
        sa.Column("conversation_id", ID, nullable=False),
        sa.Column("turn_id", ID, nullable=False),
        sa.Column("fingerprint", sa.String(128), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("content", sa.Text(), nullable=True),
        sa.Column("lease_id", ID, nullable=True),
        sa.Column("lease_holder", sa.String(128), nullable=False),
        sa.Column("lease_expires_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("regenerates_turn_id", ID, nullable=True),
        sa.Column("user_index", sa.Integer(), nullable=True),
        sa.Column("reply_index", sa.Integer(), nullable=True),
        sa.Column("partial_text", sa.Text(), nullable=False),
        sa.Column("event_sequence", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("created_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("updated_at_ms", sa.BigInteger(), nullable=False),
        _conversation_fk("turns"),
        sa.PrimaryKeyConstraint("owner_id", "conversation_id", "turn_id", name="pk_turns"),
    )
    op.create_index("ix_turns_updated_at_ms", "turns", ["updated_at_ms"])
    op.create_table(
        "usage_days",
        sa.Column("owner_id", OWNER, nullable=False),
        sa.Column("day", sa.String(10), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("turns", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("owner_id", "day", name="pk_usage_days"),
    )


def downgrade() -> None:
    op.drop_table("usage_days")
    op.drop_index("ix_turns_updated_at_ms", table_name="turns")
    op.drop_table("turns")
    op.drop_table("messages")
    op.drop_index("ix_conversations_updated_at_ms", table_name="conversations")
    op.drop_table("conversations")
