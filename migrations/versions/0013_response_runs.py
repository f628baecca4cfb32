"""Where a chained response's context lies: each item's place in its run (run key, position) and, on each response,
the prefixes of the runs along its path with their item count and the path's fingerprint (store/response_runs.py),
so a branch at any depth reads exactly its items in one indexed read.

Additive and safe across a rolling upgrade: nullable columns and a partial index of the items that have a run. Older
code leaves them NULL, and a response whose parent has no runs (stored before this revision, or by older code during
the upgrade) gets none either, so its context is walked through its parents as before. Older code reading ignores
them.

And indexes a turn maintains for nothing: erasure's indexes of tenant and user ids on threads and responses become
partial (a row without the id adds nothing to them, and erasure only ever asks for a given id), and the responses'
index of expires_ms alone goes (the purge and the stats read expiry through the index of root_id, expires_ms).

Revision ID: 0013
Revises: 0010
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from statestore.store.online_ddl import run_online

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Indexes a turn maintains that no read needs for rows without the column: made partial (a row with neither a tenant
# nor a user id adds nothing to them), and the responses' index of expires_ms alone, which no read needs, dropped.
# Indexes change no result, so older code runs the same on either shape.
_PARTIAL = (
    ("ix_threads_owner_metadata_user_id", "threads", ["owner", "metadata_user_id"], "metadata_user_id"),
    ("ix_threads_tenant_id", "threads", ["tenant_id"], "tenant_id"),
    ("ix_responses_tenant_id", "responses", ["tenant_id"], "tenant_id"),
    ("ix_responses_metadata_user_id", "responses", ["metadata_user_id"], "metadata_user_id"),
)


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _upgrade_online()
        return
    with op.batch_alter_table("responses") as batch:
        batch.add_column(sa.Column("context_runs", sa.LargeBinary(), nullable=True))
    with op.batch_alter_table("response_items") as batch:
        batch.add_column(sa.Column("run_id", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("run_position", sa.Integer(), nullable=True))
    op.create_index(
        "ix_response_items_run_id_run_position",
        "response_items",
        ["run_id", "run_position"],
        postgresql_where=sa.text("run_id IS NOT NULL"),
        sqlite_where=sa.text("run_id IS NOT NULL"),
    )
    for name, table, columns, column in _PARTIAL:
        op.drop_index(name, table_name=table)
        where = sa.text(f"{column} IS NOT NULL")
        op.create_index(name, table, columns, postgresql_where=where, sqlite_where=where)
    op.drop_index("ix_responses_expires_ms", table_name="responses")


def _upgrade_online() -> None:
    """Each step in a transaction of its own, holding one table's lock at a time and only for a moment: in one
    transaction, the migration's lock on `responses` and its wait for `response_items` deadlock with serving commits,
    which write both (found by the rolling-upgrade drill). Indexes are built and dropped CONCURRENTLY, so writes go on
    meanwhile, and a partial index is built under a new name before the old one goes, so reads keep one throughout.
    Every step may run again: a migration cut short is run again from the start."""
    steps = [
        ["ALTER TABLE responses ADD COLUMN IF NOT EXISTS context_runs BYTEA"],
        ["ALTER TABLE response_items ADD COLUMN IF NOT EXISTS run_id BIGINT"],
        ["ALTER TABLE response_items ADD COLUMN IF NOT EXISTS run_position INTEGER"],
        [
            "DROP INDEX CONCURRENTLY IF EXISTS ix_response_items_run_id_run_position",
            "CREATE INDEX CONCURRENTLY ix_response_items_run_id_run_position ON response_items (run_id, run_position) "
            "WHERE run_id IS NOT NULL",
        ],
    ]
    for name, table, columns, column in _PARTIAL:
        steps += [
            [
                f"DROP INDEX CONCURRENTLY IF EXISTS {name}_partial",
                f"CREATE INDEX CONCURRENTLY {name}_partial ON {table} ({', '.join(columns)}) "
                f"WHERE {column} IS NOT NULL",
            ],
            [f"DROP INDEX CONCURRENTLY IF EXISTS {name}"],
            [f"ALTER INDEX {name}_partial RENAME TO {name}"],
        ]
    steps.append(["DROP INDEX CONCURRENTLY IF EXISTS ix_responses_expires_ms"])
    run_online(steps)


def downgrade() -> None:
    op.create_index("ix_responses_expires_ms", "responses", ["expires_ms"])
    for name, table, columns, _ in _PARTIAL:
        op.drop_index(name, table_name=table)
        op.create_index(name, table, columns)
    op.drop_index("ix_response_items_run_id_run_position", table_name="response_items")
    with op.batch_alter_table("response_items") as batch:
        batch.drop_column("run_position")
        batch.drop_column("run_id")
    with op.batch_alter_table("responses") as batch:
        batch.drop_column("context_runs")
