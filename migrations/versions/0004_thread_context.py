"""The context a thread sends apart from its archive, and the context policy (docs/protocol.md §9).

Revision ID: 0004
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_THREAD_COUNTERS = (
    "base_position",
    "context_compacted",
    "context_truncated",
    "context_summarized",
)


def upgrade() -> None:
    # Every column has a default, so a server that predates them keeps inserting threads and appending turns.
    with op.batch_alter_table("threads") as batch:
        for name in _THREAD_COUNTERS:
            batch.add_column(sa.Column(name, sa.Integer(), server_default="0", nullable=False))
        batch.add_column(sa.Column("base_bytes", sa.BigInteger(), server_default="0", nullable=False))
        batch.add_column(sa.Column("context_head", sa.LargeBinary(), nullable=True))
        batch.add_column(sa.Column("context_tokens", sa.BigInteger(), server_default="0", nullable=False))
    with op.batch_alter_table("policies") as batch:
        batch.add_column(sa.Column("context_strategy", sa.String(length=16), server_default="none", nullable=False))
        batch.add_column(sa.Column("context_window_tokens", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("context_trigger_ratio", sa.Float(), server_default="0.8", nullable=False))
        batch.add_column(sa.Column("context_target_ratio", sa.Float(), server_default="0.5", nullable=False))
        batch.add_column(sa.Column("summary_model", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("summary_instructions", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("policies") as batch:
        for name in (
            "context_strategy",
            "context_window_tokens",
            "context_trigger_ratio",
            "context_target_ratio",
            "summary_model",
            "summary_instructions",
        ):
            batch.drop_column(name)
    with op.batch_alter_table("threads") as batch:
        for name in (*_THREAD_COUNTERS, "base_bytes", "context_head", "context_tokens"):
            batch.drop_column(name)
