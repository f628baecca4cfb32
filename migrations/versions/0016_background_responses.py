"""Background responses (docs/responses.md, "Background responses"): the table of queued and running turns
that any replica claims under a lease, and the policy field that bounds each owner's background turns.

Additive and safe across a rolling upgrade: a new table older code never reads, and a policy column with a default
(on PostgreSQL 11 and later a constant default adds the column without rewriting the table), which older code neither
reads nor writes. On PostgreSQL the column is added in a transaction of its own with a short lock timeout, retried,
so that the serving release's reads of the policies never queue behind it (as revision 0013's steps).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from statestore.store.online_ddl import run_online

revision: str = "0016"
down_revision: str | Sequence[str] | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OPEN = sa.text("status IN ('queued', 'in_progress')")


def _add_policy_column_online() -> None:
    """The column in a transaction of its own, with a short lock timeout, retried: an ALTER TABLE queued for its lock
    holds up every read of the table behind it, and each turn reads the policies now and then."""
    run_online([["ALTER TABLE policies ADD COLUMN IF NOT EXISTS max_background_turns INTEGER NOT NULL DEFAULT 16"]])


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _add_policy_column_online()
    else:
        with op.batch_alter_table("policies") as batch:
            batch.add_column(sa.Column("max_background_turns", sa.Integer(), nullable=False, server_default="16"))
    op.create_table(
        "background_responses",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("owner", sa.String(length=80), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=True),
        sa.Column("metadata_user_id", sa.String(length=512), nullable=True),
        sa.Column("conversation_id", sa.String(length=40), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("request", sa.LargeBinary(), nullable=False),
        sa.Column("headers", sa.LargeBinary(), nullable=True),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("claim_token", sa.String(length=40), nullable=True),
        sa.Column("claim_expires_ms", sa.BigInteger(), nullable=True),
        sa.Column("conversation_lease", sa.String(length=40), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("attempt", sa.Integer(), server_default="0", nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.Column("updated_ms", sa.BigInteger(), nullable=False),
        sa.Column("expires_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_background_responses"),
    )
    op.create_index(
        "ix_background_responses_status_claim_expires_ms",
        "background_responses",
        ["status", "claim_expires_ms"],
        postgresql_where=_OPEN,
        sqlite_where=_OPEN,
    )
    op.create_index(
        "ix_background_responses_owner",
        "background_responses",
        ["owner"],
        postgresql_where=_OPEN,
        sqlite_where=_OPEN,
    )
    op.create_index("ix_background_responses_expires_ms", "background_responses", ["expires_ms"])
    for column in ("tenant_id", "metadata_user_id"):
        where = sa.text(f"{column} IS NOT NULL")
        op.create_index(
            f"ix_background_responses_{column}",
            "background_responses",
            [column],
            postgresql_where=where,
            sqlite_where=where,
        )


def downgrade() -> None:
    op.drop_table("background_responses")
    with op.batch_alter_table("policies") as batch:
        batch.drop_column("max_background_turns")
