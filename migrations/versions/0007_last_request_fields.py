"""The latest turn's model and max_tokens on each thread, so the export is a replayable Messages request.

Additive: nullable columns, which older code leaves alone; threads written before this revision export without them.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("threads") as batch:
        batch.add_column(sa.Column("last_model", sa.String(length=256), nullable=True))
        batch.add_column(sa.Column("last_max_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("threads") as batch:
        batch.drop_column("last_max_tokens")
        batch.drop_column("last_model")
