"""Usage totals per thread, and the backend's own id of each stored reply (docs/protocol.md §10).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_USAGE_COLUMNS = (
    "usage_input_tokens",
    "usage_output_tokens",
    "usage_cache_creation_input_tokens",
    "usage_cache_read_input_tokens",
)


def upgrade() -> None:
    with op.batch_alter_table("threads") as batch:
        for name in _USAGE_COLUMNS:
            batch.add_column(sa.Column(name, sa.BigInteger(), server_default="0", nullable=False))
    with op.batch_alter_table("thread_messages") as batch:
        batch.add_column(sa.Column("backend_id", sa.String(length=200), nullable=True))
    op.create_index(
        "ix_thread_messages_thread_id_response_id",
        "thread_messages",
        ["thread_id", "response_id"],
        postgresql_where=sa.text("response_id IS NOT NULL"),
        sqlite_where=sa.text("response_id IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_thread_messages_thread_id_response_id", table_name="thread_messages")
    with op.batch_alter_table("thread_messages") as batch:
        batch.drop_column("backend_id")
    with op.batch_alter_table("threads") as batch:
        for name in _USAGE_COLUMNS:
            batch.drop_column(name)
