"""Tool calls and results (issue 28): `messages.parts`, an assistant message's tool calls or a tool message's
results as JSON (rows.parts_json; NULL for every other message, and for every existing row), and
`turns.input_parts`, a tool turn's results kept with its claim until the turn is stored (NULL otherwise).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.add_column("messages", sa.Column("parts", sa.Text(), nullable=True))
    op.add_column("turns", sa.Column("input_parts", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("turns") as batch:  # SQLite drops a column by rebuilding the table
        batch.drop_column("input_parts")
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("parts")
