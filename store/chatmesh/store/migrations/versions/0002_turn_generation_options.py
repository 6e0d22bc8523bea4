"""A turn record keeps its generation options (issue 33): `turns.generation_options`, the caller's JSON, for every
attempt that claims the turn again. Existing rows get '' (none kept: their next claim uses its own).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.add_column("turns", sa.Column("generation_options", sa.Text(), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("turns") as batch:  # SQLite drops a column by rebuilding the table
        batch.drop_column("generation_options")
