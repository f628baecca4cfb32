"""Data keys for encryption at rest (docs/encryption.md).

`data_keys` holds one wrapped data key per erasure scope. Additive: older code never reads it; a database whose content
was sealed must not be served by code without encryption (the server refuses to start when this table has rows and no
master keys are set).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | Sequence[str] | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "data_keys",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("scope_hash", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=80), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=True),
        sa.Column("user_id", sa.String(length=512), nullable=True),
        sa.Column("master_id", sa.String(length=16), nullable=False),
        sa.Column("wrapped", sa.LargeBinary(), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_data_keys"),
        sa.UniqueConstraint("scope_hash", name="uq_data_keys_scope_hash"),
    )
    op.create_index("ix_data_keys_tenant_id", "data_keys", ["tenant_id"])
    op.create_index("ix_data_keys_user_id", "data_keys", ["user_id"])
    op.create_index("ix_data_keys_master_id", "data_keys", ["master_id"])


def downgrade() -> None:
    op.drop_table("data_keys")
