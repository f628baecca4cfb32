"""The console's sign-in throttle and its server-side sign-outs.

`console_sign_ins` counts sign-in attempts per client address and per admin token name in fixed windows;
`console_sign_outs` holds the nonce of every session signed out until its cookie would have expired, so a copied
cookie stops working at sign-out. Additive: older code never reads either table, and its sessions stay valid.

Revision ID: 0015
Revises: 0013
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "console_sign_ins",
        sa.Column("scope", sa.String(length=300), nullable=False),
        sa.Column("window_ms", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("scope", "window_ms", name="pk_console_sign_ins"),
    )
    op.create_index("ix_console_sign_ins_window_ms", "console_sign_ins", ["window_ms"])
    op.create_table(
        "console_sign_outs",
        sa.Column("nonce", sa.String(length=64), nullable=False),
        sa.Column("expires_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("nonce", name="pk_console_sign_outs"),
    )
    op.create_index("ix_console_sign_outs_expires_ms", "console_sign_outs", ["expires_ms"])


def downgrade() -> None:
    op.drop_index("ix_console_sign_outs_expires_ms", table_name="console_sign_outs")
    op.drop_table("console_sign_outs")
    op.drop_index("ix_console_sign_ins_window_ms", table_name="console_sign_ins")
    op.drop_table("console_sign_ins")
