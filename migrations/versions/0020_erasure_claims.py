"""Erasure claims (docs/administration.md#erasure): a running erasure is held by the replica running it, under a lease
it renews, so that another replica takes up an erasure whose replica stopped. Additive: older code never reads them,
and an erasure older code began (no claim) is taken up once it is older than a lease.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | Sequence[str] | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("erasures", sa.Column("claim_token", sa.String(length=32), nullable=True))
    op.add_column("erasures", sa.Column("claim_expires_ms", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("erasures") as batch:
        batch.drop_column("claim_expires_ms")
        batch.drop_column("claim_token")
