"""A response made on a conversation points at the conversation's items instead of copying them: its first position
there and how many of them are its input and its output (docs/responses.md, "Storage").

Additive: nullable columns, which older code leaves alone. Responses written before this revision keep their copy in
response_items and are read from there; newer ones have these columns set and no response_items rows.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("responses") as batch:
        batch.add_column(sa.Column("conversation_position", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("input_count", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("output_count", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("responses") as batch:
        batch.drop_column("output_count")
        batch.drop_column("input_count")
        batch.drop_column("conversation_position")
