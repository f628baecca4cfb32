"""What a response's turn measured and where its chain's context starts (docs/protocol.md §9 on the Responses door): the
backend's token count and the bytes it counted, so the next turn's estimate uses the chain's own tokens per byte;
how many bytes of the chain's joined context the context keeps (from its end) and which response holds the summary
that opens it, so a later turn continues from the same base. A conversation keeps the measure of its last turn too.

Additive: nullable columns, which older code leaves alone; a response written before this revision has no measure
(the default ratio applies) and sends its whole chain, as before.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from statestore.store.online_ddl import run_online

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # Each column on its own (store/online_ddl.py): in one transaction, the lock on `responses` and the wait for
        # `conversations` deadlocked with a serving conversation turn's commit, which writes both (the drill's 503).
        run_online(
            [
                [f"ALTER TABLE responses ADD COLUMN IF NOT EXISTS {column}"]
                for column in (
                    "context_tokens BIGINT",
                    "context_bytes BIGINT",
                    "context_kept BIGINT",
                    "context_head_id VARCHAR(40)",
                    "context_head BYTEA",
                )
            ]
            + [
                [f"ALTER TABLE conversations ADD COLUMN IF NOT EXISTS {column}"]
                for column in ("context_tokens BIGINT", "context_bytes BIGINT")
            ]
        )
        return
    with op.batch_alter_table("responses") as batch:
        batch.add_column(sa.Column("context_tokens", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("context_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("context_kept", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("context_head_id", sa.String(length=40), nullable=True))
        batch.add_column(sa.Column("context_head", sa.LargeBinary(), nullable=True))
    with op.batch_alter_table("conversations") as batch:
        batch.add_column(sa.Column("context_tokens", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("context_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("conversations") as batch:
        batch.drop_column("context_bytes")
        batch.drop_column("context_tokens")
    with op.batch_alter_table("responses") as batch:
        batch.drop_column("context_head")
        batch.drop_column("context_head_id")
        batch.drop_column("context_kept")
        batch.drop_column("context_bytes")
        batch.drop_column("context_tokens")
