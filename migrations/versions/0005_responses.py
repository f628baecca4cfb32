"""The Responses front door: responses and their items, conversations and theirs (docs/responses.md). Additive: new
tables only.

Revision ID: 0005
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("owner", sa.String(80), nullable=False),
        sa.Column("tenant_id", sa.String(40), nullable=True),
        sa.Column("metadata_user_id", sa.String(512), nullable=True),
        sa.Column("parent_id", sa.String(40), nullable=True),
        sa.Column("root_id", sa.String(40), nullable=False),
        sa.Column("conversation_id", sa.String(40), nullable=True),
        sa.Column("depth", sa.Integer(), nullable=False),
        sa.Column("chain_bytes", sa.BigInteger(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.Column("expires_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_responses"),
    )
    op.create_index("ix_responses_root_id_expires_ms", "responses", ["root_id", "expires_ms"])
    op.create_index("ix_responses_expires_ms", "responses", ["expires_ms"])
    op.create_index("ix_responses_tenant_id", "responses", ["tenant_id"])
    op.create_index("ix_responses_metadata_user_id", "responses", ["metadata_user_id"])
    op.create_table(
        "response_items",
        sa.Column("response_id", sa.String(40), nullable=False),
        sa.Column("position", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("is_output", sa.Boolean(), nullable=False),
        sa.Column("item_id", sa.String(200), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("rendered", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["response_id"], ["responses.id"], name="fk_response_items_response_id_responses", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("response_id", "position", name="pk_response_items"),
    )
    op.create_table(
        "conversations",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("owner", sa.String(80), nullable=False),
        sa.Column("tenant_id", sa.String(40), nullable=True),
        sa.Column("metadata_user_id", sa.String(512), nullable=True),
        sa.Column("metadata", sa.LargeBinary(), nullable=False),
        sa.Column("next_position", sa.Integer(), server_default="0", nullable=False),
        sa.Column("lease_token", sa.String(40), nullable=True),
        sa.Column("lease_expires_ms", sa.BigInteger(), nullable=True),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.Column("expires_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_conversations"),
    )
    op.create_index("ix_conversations_expires_ms", "conversations", ["expires_ms"])
    op.create_index("ix_conversations_tenant_id", "conversations", ["tenant_id"])
    op.create_index("ix_conversations_metadata_user_id", "conversations", ["metadata_user_id"])
    op.create_table(
        "conversation_items",
        sa.Column("conversation_id", sa.String(40), nullable=False),
        sa.Column("position", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("item_id", sa.String(200), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("rendered", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name="fk_conversation_items_conversation_id_conversations",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("conversation_id", "position", name="pk_conversation_items"),
    )
    op.create_index(
        "ix_conversation_items_conversation_id_item_id", "conversation_items", ["conversation_id", "item_id"]
    )


def downgrade() -> None:
    op.drop_table("conversation_items")
    op.drop_table("conversations")
    op.drop_table("response_items")
    op.drop_table("responses")
