"""Erasure retries (docs/administration.md#erasure): a failed erasure is run again by the servers' sweep, after a
growing delay, a bounded number of times. `attempts` counts an erasure's runs (1 for every erasure begun before), and
`retry_at_ms` says when a failed one is run again (NULL: never, as every erasure that failed before). And an index of
only the running and failed erasures, oldest first, for the sweep each server runs every few seconds, which read the
whole table, done erasures included, before.

Additive and safe across a rolling upgrade: older code neither reads the columns nor uses the index, and an erasure
it begins gets the column's default (1 attempt). On PostgreSQL each step runs in a transaction of its own with a short
lock timeout, retried, and the index is built CONCURRENTLY, so the serving release's sweeps and erasures go on
meanwhile (as revision 0013's steps).

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from statestore.store.online_ddl import run_online

revision: str = "0021"
down_revision: str | Sequence[str] | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_INDEX = "ix_erasures_created_ms"
_SWEPT = "status IN ('running', 'failed')"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # Every step may run again: a migration cut short is run again from the start (an index whose CONCURRENTLY
        # build was cut short is left invalid, so it is dropped and built again).
        run_online(
            [
                ["ALTER TABLE erasures ADD COLUMN IF NOT EXISTS attempts INTEGER NOT NULL DEFAULT 1"],
                ["ALTER TABLE erasures ADD COLUMN IF NOT EXISTS retry_at_ms BIGINT"],
                [
                    f"DROP INDEX CONCURRENTLY IF EXISTS {_INDEX}",
                    f"CREATE INDEX CONCURRENTLY {_INDEX} ON erasures (created_ms) WHERE {_SWEPT}",
                ],
            ]
        )
        return
    with op.batch_alter_table("erasures") as batch:
        batch.add_column(sa.Column("attempts", sa.Integer(), nullable=False, server_default="1"))
        batch.add_column(sa.Column("retry_at_ms", sa.BigInteger(), nullable=True))
    op.create_index(_INDEX, "erasures", ["created_ms"], sqlite_where=sa.text(_SWEPT))


def downgrade() -> None:
    op.drop_index(_INDEX, table_name="erasures")
    with op.batch_alter_table("erasures") as batch:
        batch.drop_column("retry_at_ms")
        batch.drop_column("attempts")
