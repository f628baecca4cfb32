"""The tables (SQLAlchemy Core). Times are integer milliseconds since the epoch, taken from the server's clock."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    false,
    text,
)

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


def _partial(*columns: str, where: str) -> Index:
    """An index of only the rows `where` holds, on PostgreSQL and SQLite alike (named by the convention)."""
    return Index(None, *columns, postgresql_where=text(where), sqlite_where=text(where))


# One row a conversation. `system`/`tools` hold the JSON bytes as the create sent them (forwarded verbatim);
# the *_fp columns hold a hash of their canonical JSON, compared on a continue (docs/protocol.md §3).
threads = Table(
    "threads",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("owner", String(80), nullable=False),
    Column("tenant_id", String(40), nullable=True),
    Column("session_id", String(128), nullable=True),
    Column("metadata_user_id", String(256), nullable=True),
    Column("system", LargeBinary, nullable=True),
    Column("tools", LargeBinary, nullable=True),
    Column("system_fp", String(64), nullable=True),
    Column("tools_fp", String(64), nullable=True),
    Column("output_config_fp", String(64), nullable=True),
    # Block cache_control markers inside the stored system and tools, which every later turn carries.
    Column("fixed_markers", Integer, nullable=False, server_default="0"),
    # NULL while the create that made the row has not been answered yet.
    Column("head_message_id", String(80), nullable=True),
    Column("head_position", Integer, nullable=False, server_default="0"),
    Column("byte_count", BigInteger, nullable=False, server_default="0"),
    Column("turn_count", Integer, nullable=False, server_default="0"),
    # The backend's usage of the stored turns, added up at each commit (docs/protocol.md §10).
    Column("usage_input_tokens", BigInteger, nullable=False, server_default="0"),
    Column("usage_output_tokens", BigInteger, nullable=False, server_default="0"),
    Column("usage_cache_creation_input_tokens", BigInteger, nullable=False, server_default="0"),
    Column("usage_cache_read_input_tokens", BigInteger, nullable=False, server_default="0"),
    # The context a rebuild sends (docs/protocol.md §9): `context_head` (a compaction reply cut to its compaction block,
    # or a summary) in place of the messages before `base_position`, then the stored messages from there on.
    # `base_bytes` is the bytes of the messages before the base, so the context's size is byte_count - base_bytes
    # plus the head's; a server that predates these columns only appends, which keeps that sum right.
    Column("base_position", Integer, nullable=False, server_default="0"),
    Column("base_bytes", BigInteger, nullable=False, server_default="0"),
    Column("context_head", LargeBinary, nullable=True),
    # The context's size in tokens after the last turn, from the backend's usage.
    Column("context_tokens", BigInteger, nullable=False, server_default="0"),
    Column("context_compacted", Integer, nullable=False, server_default="0"),
    Column("context_truncated", Integer, nullable=False, server_default="0"),
    Column("context_summarized", Integer, nullable=False, server_default="0"),
    # The latest stored turn's model and max_tokens (NULL on threads written before revision 0007): the export
    # carries them so it is a request a client can replay.
    Column("last_model", String(256), nullable=True),
    Column("last_max_tokens", Integer, nullable=True),
    Column("lease_token", String(40), nullable=True),
    Column("lease_expires_ms", BigInteger, nullable=True),
    Column("ttl_seconds", Integer, nullable=False),
    Column("created_ms", BigInteger, nullable=False),
    Column("updated_ms", BigInteger, nullable=False),
    Column("expires_ms", BigInteger, nullable=False),
    Index(None, "owner", "updated_ms"),
    Index(None, "expires_ms"),
    # Only erasure looks a thread up by its user or tenant: a thread with neither is not in these (revision 0013), so
    # a turn's update of the row (a new version, since updated_ms and expires_ms are indexed) adds nothing to them.
    _partial("owner", "metadata_user_id", where="metadata_user_id IS NOT NULL"),
    _partial("tenant_id", where="tenant_id IS NOT NULL"),
)

# One row a message, as canonical JSON bytes with earlier-turn cache_control already dropped. Replies carry the
# response id statestore minted for them.
thread_messages = Table(
    "thread_messages",
    metadata,
    Column("thread_id", String(40), ForeignKey("threads.id", ondelete="CASCADE"), primary_key=True),
    Column("position", Integer, primary_key=True, autoincrement=False),
    Column("body", LargeBinary, nullable=False),
    Column("response_id", String(80), nullable=True),
    # The backend's own id of a reply, for cache diagnostics (docs/protocol.md §10).
    Column("backend_id", String(200), nullable=True),
    _partial("thread_id", "response_id", where="response_id IS NOT NULL"),
)

# A session name bound to the owner's current thread (docs/protocol.md §6).
sessions = Table(
    "sessions",
    metadata,
    Column("owner", String(80), primary_key=True),
    Column("name", String(128), primary_key=True),
    Column("thread_id", String(40), ForeignKey("threads.id", ondelete="CASCADE"), nullable=False),
    Column("updated_ms", BigInteger, nullable=False),
    Index(None, "thread_id"),
)

tenants = Table(
    "tenants",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("name", String(200), nullable=False, unique=True),
    Column("disabled", Boolean, nullable=False, server_default=false()),
    Column("created_ms", BigInteger, nullable=False),
)

# statestore's own API keys (keys mode): only a hash of the secret is kept.
api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("tenant_id", String(40), ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
    Column("label", String(200), nullable=True),
    Column("prefix", String(24), nullable=False),
    Column("key_hash", String(64), nullable=False, unique=True),
    Column("created_ms", BigInteger, nullable=False),
    Column("revoked_ms", BigInteger, nullable=True),
    Index(None, "tenant_id"),
)

# Retention policies: scope "default", or a tenant id for that tenant's override.
policies = Table(
    "policies",
    metadata,
    Column("scope", String(40), primary_key=True),
    Column("threads_enabled", Boolean, nullable=False),
    Column("sessions_enabled", Boolean, nullable=False),
    Column("default_ttl_seconds", Integer, nullable=False),
    Column("max_ttl_seconds", Integer, nullable=False),
    Column("max_thread_bytes", BigInteger, nullable=False),
    Column("max_messages", Integer, nullable=False),
    # The context policy (docs/protocol.md §9; statestore/policy_fields.py).
    Column("context_strategy", String(16), nullable=False, server_default="none"),
    Column("context_window_tokens", Integer, nullable=True),
    Column("context_trigger_ratio", Float, nullable=False, server_default="0.8"),
    Column("context_target_ratio", Float, nullable=False, server_default="0.5"),
    Column("summary_model", String(200), nullable=True),
    Column("summary_instructions", Text, nullable=True),
    # Background turns queued or running at once per owner (revision 0016); 0 turns background off.
    Column("max_background_turns", Integer, nullable=False, server_default="16"),
    # How long a write's outcome is kept under its Idempotency-Key (revision 0018).
    Column("idempotency_ttl_seconds", Integer, nullable=False, server_default="86400"),
    Column("updated_ms", BigInteger, nullable=False),
)

# Append-only record of admin changes: who, when, what, before and after. Never message content.
audit_log = Table(
    "audit_log",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at_ms", BigInteger, nullable=False),
    Column("actor", String(200), nullable=False),
    Column("action", String(100), nullable=False),
    Column("target", String(200), nullable=True),
    Column("before", Text, nullable=True),
    Column("after", Text, nullable=True),
    Index(None, "at_ms"),
)

# Running totals that outlive the rows they count (threads purged, threads erased).
counters = Table(
    "counters",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("value", BigInteger, nullable=False),
)

# Turns and stored bytes per UTC day and front door, added to by each turn's commit (never counted from history): the
# console's charts. A day's count is spread over a few shard rows so concurrent commits do not queue on one row lock;
# each door has shards of its own (store/usage_rows.py), so the key stays (day, shard), which code from before
# revision 0009 upserts on.
daily_usage = Table(
    "daily_usage",
    metadata,
    Column("day", Integer, primary_key=True, autoincrement=False),  # days since the epoch, UTC
    Column("shard", Integer, primary_key=True, autoincrement=False),
    Column("turns", BigInteger, nullable=False),
    Column("bytes", BigInteger, nullable=False),
    # "messages" (threads and sessions) or "responses" (responses and conversations); older code leaves the default.
    Column("door", String(16), nullable=False, server_default="messages"),
)

# -- the Responses front door (docs/responses.md)
# ------------------------------------------------------------------------

# One row a stored response. A response points to its parent; `root_id` names the first response of its tree, which
# is kept while any response of the tree is live (a continue refreshes only its own row's expiry).
responses = Table(
    "responses",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("owner", String(80), nullable=False),
    Column("tenant_id", String(40), nullable=True),
    Column("metadata_user_id", String(512), nullable=True),
    Column("parent_id", String(40), nullable=True),
    Column("root_id", String(40), nullable=False),
    Column("conversation_id", String(40), nullable=True),
    # A turn on a conversation stores its items once, in conversation_items: from this position on, its inputs then
    # its outputs (NULL: the items are in response_items, as for every response before revision 0008).
    Column("conversation_position", Integer, nullable=True),
    Column("input_count", Integer, nullable=True),
    Column("output_count", Integer, nullable=True),
    Column("depth", Integer, nullable=False),
    # Bytes of rendered context from the root through this response: the policy's size bound, checked in O(1).
    Column("chain_bytes", BigInteger, nullable=False),
    Column("body", LargeBinary, nullable=False),  # the Response JSON as returned
    Column("created_ms", BigInteger, nullable=False),
    Column("expires_ms", BigInteger, nullable=False),
    # docs/protocol.md §9 (revision 0010): the backend's token count of this turn and the bytes it counted; the bytes of
    # the chain's joined context its context keeps, counted from the end (NULL: all of it); the response whose
    # `context_head` (a summary message) opens it.
    Column("context_tokens", BigInteger, nullable=True),
    Column("context_bytes", BigInteger, nullable=True),
    Column("context_kept", BigInteger, nullable=True),
    Column("context_head_id", String(40), nullable=True),
    Column("context_head", LargeBinary, nullable=True),
    # Where its context lies in response_items' runs (store/response_runs.py; revision 0013). NULL: walked.
    Column("context_runs", LargeBinary, nullable=True),
    # The purge's and the stats' (a tree goes when its last response expires); no index of expires_ms alone
    # (revision 0013): nothing reads responses by it but a count of the stats, which this index serves too.
    Index(None, "root_id", "expires_ms"),
    # Erasure's; a response with no tenant or user is in neither (revision 0013).
    _partial("tenant_id", where="tenant_id IS NOT NULL"),
    _partial("metadata_user_id", where="metadata_user_id IS NOT NULL"),
)

# A response's input items (then its output items), each as its Responses JSON and its rendered Chat Completions
# bytes (kind "message": a whole message; "call": a tool_calls entry; "none": not sent).
response_items = Table(
    "response_items",
    metadata,
    Column("response_id", String(40), ForeignKey("responses.id", ondelete="CASCADE"), primary_key=True),
    Column("position", Integer, primary_key=True, autoincrement=False),
    Column("is_output", Boolean, nullable=False),
    Column("item_id", String(200), nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("kind", String(8), nullable=False),
    Column("rendered", LargeBinary, nullable=False),
    # The item's place in its run (store/response_runs.py; revision 0013): NULL for items in none.
    Column("run_id", BigInteger, nullable=True),
    Column("run_position", Integer, nullable=True),
    _partial("run_id", "run_position", where="run_id IS NOT NULL"),
)

conversations = Table(
    "conversations",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("owner", String(80), nullable=False),
    Column("tenant_id", String(40), nullable=True),
    Column("metadata_user_id", String(512), nullable=True),
    Column("metadata", LargeBinary, nullable=False),
    Column("next_position", Integer, nullable=False, server_default="0"),
    Column("lease_token", String(40), nullable=True),
    Column("lease_expires_ms", BigInteger, nullable=True),
    Column("created_ms", BigInteger, nullable=False),
    Column("expires_ms", BigInteger, nullable=False),
    # The backend's token count of the last turn on it and the bytes it counted (revision 0010, docs/protocol.md §9).
    Column("context_tokens", BigInteger, nullable=True),
    Column("context_bytes", BigInteger, nullable=True),
    Index(None, "expires_ms"),
    Index(None, "tenant_id"),
    Index(None, "metadata_user_id"),
)

conversation_items = Table(
    "conversation_items",
    metadata,
    Column("conversation_id", String(40), ForeignKey("conversations.id", ondelete="CASCADE"), primary_key=True),
    Column("position", Integer, primary_key=True, autoincrement=False),
    Column("item_id", String(200), nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("kind", String(8), nullable=False),
    Column("rendered", LargeBinary, nullable=False),
    Index(None, "conversation_id", "item_id"),
)

# The console's sign-in throttle: attempts counted per scope ("address:<ip>" or "token:<name>") in fixed windows.
console_sign_ins = Table(
    "console_sign_ins",
    metadata,
    Column("scope", String(300), primary_key=True),
    Column("window_ms", BigInteger, primary_key=True, autoincrement=False),
    Column("attempts", Integer, nullable=False),
    Index(None, "window_ms"),
)

# Console sessions ended by a sign-out, kept until the cookie would have expired: a copied cookie opens nothing.
console_sign_outs = Table(
    "console_sign_outs",
    metadata,
    Column("nonce", String(64), primary_key=True),
    Column("expires_ms", BigInteger, nullable=False, index=True),
)


# Background responses (docs/responses.md, "Background responses"; revision 0016): a turn queued in the
# database and claimed under a lease by any replica, so none is lost or stuck when a replica dies. The request is kept
# as sent, with the few headers a replica needs to run it as its client would have (the credential, cleared once the
# turn ends); `body` is the Response as of its last change of status (the stored response, once it completed, is the
# responses row's). `claim_*` is the lease of the replica running it; `attempt` counts claims, and tags the events a
# run publishes, so two runs never write one stream.
background_responses = Table(
    "background_responses",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("owner", String(80), nullable=False),
    Column("tenant_id", String(40), nullable=True),
    Column("metadata_user_id", String(512), nullable=True),
    Column("conversation_id", String(40), nullable=True),
    Column("status", String(16), nullable=False),
    Column("request", LargeBinary, nullable=False),
    Column("headers", LargeBinary, nullable=True),
    Column("body", LargeBinary, nullable=False),
    Column("claim_token", String(40), nullable=True),
    Column("claim_expires_ms", BigInteger, nullable=True),
    Column("conversation_lease", String(40), nullable=True),
    Column("cancel_requested", Boolean, nullable=False, server_default=false()),
    Column("attempt", Integer, nullable=False, server_default="0"),
    Column("created_ms", BigInteger, nullable=False),
    Column("updated_ms", BigInteger, nullable=False),
    Column("expires_ms", BigInteger, nullable=False),
    # The claimers' scan and each owner's bound read only the turns not yet ended.
    _partial("status", "claim_expires_ms", where="status IN ('queued', 'in_progress')"),
    _partial("owner", where="status IN ('queued', 'in_progress')"),
    Index(None, "expires_ms"),
    _partial("tenant_id", where="tenant_id IS NOT NULL"),
    _partial("metadata_user_id", where="metadata_user_id IS NOT NULL"),
)

# Data keys (docs/encryption.md; revision 0017): one per erasure scope (owner, and `metadata.user_id` when
# given), stored only wrapped under a master key. By default in the content database; STATESTORE_KEYSTORE_URL puts
# this table in a database of its own, so a backup of the content carries no key. Erasure deletes a scope's row first:
# from then on its content opens nowhere, backups included.
data_keys = Table(
    "data_keys",
    metadata,
    Column("id", String(32), primary_key=True),  # hex of the 16 bytes every value sealed under it carries
    Column("scope_hash", String(64), nullable=False, unique=True),  # sha256(owner, user id): one key a scope
    Column("owner", String(80), nullable=False),
    Column("tenant_id", String(40), nullable=True),
    Column("user_id", String(512), nullable=True),
    Column("master_id", String(16), nullable=False),
    Column("wrapped", LargeBinary, nullable=False),
    Column("created_ms", BigInteger, nullable=False),
    Index(None, "tenant_id"),
    Index(None, "user_id"),
    Index(None, "master_id"),
)

# Idempotency keys (docs/responses.md, "Retries that never store twice"; revision 0018): one row a key an owner sent on
# a write. While the write runs it holds a claim (token, expiry, renewed) and the ids the write is to store
# (`intended`), written before its commit; once it ends well, its outcome (status, headers, body or stream, sealed with
# encryption on) is kept until `expires_ms`. `fingerprint` is a hash of the route and body, never the body.
idempotency_keys = Table(
    "idempotency_keys",
    metadata,
    Column("owner", String(80), primary_key=True),
    Column("key", String(255), primary_key=True),
    Column("tenant_id", String(40), nullable=True),
    Column("metadata_user_id", String(512), nullable=True),
    Column("fingerprint", String(64), nullable=False),
    Column("intended", Text, nullable=True),
    Column("claim_token", String(40), nullable=True),
    Column("claim_expires_ms", BigInteger, nullable=True),
    Column("status", Integer, nullable=True),
    Column("outcome", LargeBinary, nullable=True),
    Column("created_ms", BigInteger, nullable=False),
    Column("expires_ms", BigInteger, nullable=False),
    Index(None, "expires_ms"),
    _partial("tenant_id", where="tenant_id IS NOT NULL"),
    _partial("metadata_user_id", where="metadata_user_id IS NOT NULL"),
)

# Erasures (docs/administration.md#erasure; revision 0019): one row each, `running` until every row of its tenant
# and/or user is gone and its data keys are destroyed everywhere (`done`), or `failed`; what it erased, once done.
# A running erasure is claimed by the process running it (revision 0020), until `claim_expires_ms` unless renewed:
# past it, another replica takes the erasure up. `threads`, `responses`, `conversations` hold what it erased so far.
# A failed erasure is run again from `retry_at_ms` (revision 0021), NULL once it is failed for good; `attempts` counts
# its runs. The servers' sweep reads only running and failed rows, oldest first: the partial index holds just those.
erasures = Table(
    "erasures",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("actor", String(200), nullable=False),
    Column("tenant_id", String(40), nullable=True),
    Column("user_id", String(512), nullable=True),
    Column("status", String(16), nullable=False),
    Column("created_ms", BigInteger, nullable=False),
    Column("finished_ms", BigInteger, nullable=True),
    Column("threads", Integer, nullable=True),
    Column("responses", Integer, nullable=True),
    Column("conversations", Integer, nullable=True),
    Column("claim_token", String(32), nullable=True),
    Column("claim_expires_ms", BigInteger, nullable=True),
    Column("attempts", Integer, nullable=False, server_default="1"),
    Column("retry_at_ms", BigInteger, nullable=True),
    _partial("created_ms", where="status IN ('running', 'failed')"),
)
