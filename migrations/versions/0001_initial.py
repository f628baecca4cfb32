"""Initial schema: threads and their messages, sessions, tenants, API keys, retention policies, audit log.

Revision ID: 0001
Revises:
Create Date: 2026-11-29

Spelled out rather than built from statestore.store.schema, so that later edits of schema.py cannot change what
this revision did; `alembic check` (tests/integration/test_migrations.py) keeps the two in step.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "threads",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("owner", sa.String(length=80), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=True),
        sa.Column("session_id", sa.String(length=128), nullable=True),
        sa.Column("metadata_user_id", sa.String(length=256), nullable=True),
        sa.Column("system", sa.LargeBinary(), nullable=True),
        sa.Column("tools", sa.LargeBinary(), nullable=True),
        sa.Column("system_fp", sa.String(length=64), nullable=True),
        sa.Column("tools_fp", sa.String(length=64), nullable=True),
        sa.Column("output_config_fp", sa.String(length=64), nullable=True),
        sa.Column("fixed_markers", sa.Integer(), server_default="0", nullable=False),
        sa.Column("head_message_id", sa.String(length=80), nullable=True),
        sa.Column("head_position", sa.Integer(), server_default="0", nullable=False),
        sa.Column("byte_count", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("turn_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("lease_token", sa.String(length=40), nullable=True),
        sa.Column("lease_expires_ms", sa.BigInteger(), nullable=True),
        sa.Column("ttl_seconds", sa.Integer(), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.Column("updated_ms", sa.BigInteger(), nullable=False),
        sa.Column("expires_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_threads")),
    )
    op.create_index(op.f("ix_threads_owner_updated_ms"), "threads", ["owner", "updated_ms"])
    op.create_index(op.f("ix_threads_expires_ms"), "threads", ["expires_ms"])
    op.create_index(op.f("ix_threads_owner_metadata_user_id"), "threads", ["owner", "metadata_user_id"])
    op.create_index(op.f("ix_threads_tenant_id"), "threads", ["tenant_id"])

    op.create_table(
        "thread_messages",
        sa.Column("thread_id", sa.String(length=40), nullable=False),
        sa.Column("position", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("response_id", sa.String(length=80), nullable=True),
        sa.ForeignKeyConstraint(
            ["thread_id"], ["threads.id"], name=op.f("fk_thread_messages_thread_id_threads"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("thread_id", "position", name=op.f("pk_thread_messages")),
    )

    op.create_table(
        "sessions",
        sa.Column("owner", sa.String(length=80), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("thread_id", sa.String(length=40), nullable=False),
        sa.Column("updated_ms", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["thread_id"], ["threads.id"], name=op.f("fk_sessions_thread_id_threads"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("owner", "name", name=op.f("pk_sessions")),
    )
    op.create_index(op.f("ix_sessions_thread_id"), "sessions", ["thread_id"])

    op.create_table(
        "tenants",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        # sa.false(), not a literal: PostgreSQL wants `false`, SQLite stores booleans as 0/1.
        sa.Column("disabled", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )

    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("label", sa.String(length=200), nullable=True),
        sa.Column("prefix", sa.String(length=24), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.Column("revoked_ms", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])

    op.create_table(
        "policies",
        sa.Column("scope", sa.String(length=40), nullable=False),
        sa.Column("threads_enabled", sa.Boolean(), nullable=False),
        sa.Column("sessions_enabled", sa.Boolean(), nullable=False),
        sa.Column("default_ttl_seconds", sa.Integer(), nullable=False),
        sa.Column("max_ttl_seconds", sa.Integer(), nullable=False),
        sa.Column("max_thread_bytes", sa.BigInteger(), nullable=False),
        sa.Column("max_messages", sa.Integer(), nullable=False),
        sa.Column("updated_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("scope", name=op.f("pk_policies")),
    )

    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at_ms", sa.BigInteger(), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("action", sa.String(length=100), nullable=False),
        sa.Column("target", sa.String(length=200), nullable=True),
        sa.Column("before", sa.Text(), nullable=True),
        sa.Column("after", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    op.create_index(op.f("ix_audit_log_at_ms"), "audit_log", ["at_ms"])


def downgrade() -> None:
    # Children before parents; a table's indexes go with it.
    op.drop_table("audit_log")
    op.drop_table("policies")
    op.drop_table("api_keys")
    op.drop_table("tenants")
    op.drop_table("sessions")
    op.drop_table("thread_messages")
    op.drop_table("threads")
