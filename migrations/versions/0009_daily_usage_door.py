"""Daily usage by front door: which door (the Messages API's threads and sessions, or the Responses API's responses
and conversations) each counted turn came through.

Additive: the primary key stays (day, shard), each door counting on shards of its own (store/usage_rows.py), so code
from before this revision, which upserts on (day, shard) and leaves `door` to its default, keeps working on this
schema and counts what it always counted: thread turns, the Messages door's.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("daily_usage") as batch:
        batch.add_column(sa.Column("door", sa.String(length=16), nullable=False, server_default="messages"))


def downgrade() -> None:
    # Rows of both doors stay: older code adds up every shard of a day, so its totals keep the Responses turns.
    with op.batch_alter_table("daily_usage") as batch:
        batch.drop_column("door")
