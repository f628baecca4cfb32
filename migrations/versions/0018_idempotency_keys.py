"""Idempotency keys (docs/responses.md, "Retries that never store twice"; docs/protocol.md §11): the outcome of a write
kept under its owner's `Idempotency-Key` for the policy's `idempotency_ttl_seconds`, and that policy field.

Additive and safe across a rolling upgrade: a new table older code never reads, and a policy column with a constant
default, which older code neither reads nor writes. On PostgreSQL the column is added in a transaction of its own with a
short lock timeout, retried (as revision 0016's), so the serving release's policy reads never queue behind it.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from statestore.store.online_ddl import run_online

revision: str = "0018"
down_revision: str | Sequence[str] | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        run_online(
            [["ALTER TABLE policies ADD COLUMN IF NOT EXISTS idempotency_ttl_seconds INTEGER NOT NULL DEFAULT 86400"]]
        )
    else:
        with op.batch_alter_table("policies") as batch:
            batch.add_column(sa.Column("idempotency_ttl_seconds", sa.Integer(), nullable=False, server_default="86400"))
    op.create_table(
        "idempotency_keys",
        sa.Column("owner", sa.String(length=80), nullable=False),
        sa.Column("key", sa.String(length=255), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=True),
        sa.Column("metadata_user_id", sa.String(length=512), nullable=True),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("intended", sa.Text(), nullable=True),
        sa.Column("claim_token", sa.String(length=40), nullable=True),
        sa.Column("claim_expires_ms", sa.BigInteger(), nullable=True),
        sa.Column("status", sa.Integer(), nullable=True),
        sa.Column("outcome", sa.LargeBinary(), nullable=True),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.Column("expires_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("owner", "key", name="pk_idempotency_keys"),
    )
    op.create_index("ix_idempotency_keys_expires_ms", "idempotency_keys", ["expires_ms"])
    for column in ("tenant_id", "metadata_user_id"):
        where = sa.text(f"{column} IS NOT NULL")
        op.create_index(
            f"ix_idempotency_keys_{column}",
            "idempotency_keys",
            [column],
            postgresql_where=where,
            sqlite_where=where,
        )


def downgrade() -> None:
    op.drop_table("idempotency_keys")
    with op.batch_alter_table("policies") as batch:
        batch.drop_column("idempotency_ttl_seconds")
