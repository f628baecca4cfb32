"""Erasures (docs/administration.md#erasure): `POST /admin/v1/erase` answers at once with an erasure, which runs on and
is polled here until it is done. Additive: older code never reads it.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | Sequence[str] | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "erasures",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=True),
        sa.Column("user_id", sa.String(length=512), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.Column("finished_ms", sa.BigInteger(), nullable=True),
        sa.Column("threads", sa.Integer(), nullable=True),
        sa.Column("responses", sa.Integer(), nullable=True),
        sa.Column("conversations", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_erasures"),
    )


def downgrade() -> None:
    op.drop_table("erasures")
