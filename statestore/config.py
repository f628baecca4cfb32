"""Settings, read once from the environment (prefix STATESTORE_)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from statestore.encryption.master_keys import MasterKeyRing, read_master_keys
from statestore.sealing import parse_keys
from statestore.store.resp import parse_url, split_cluster_flag

DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///./statestore.db"


class Settings(BaseSettings):
    # hide_input_in_errors: a refused value (a malformed key ring, a secret) is never echoed into a start-up error.
    model_config = SettingsConfigDict(env_prefix="STATESTORE_", extra="ignore", frozen=True, hide_input_in_errors=True)

    database_url: str = DEFAULT_DATABASE_URL
    database_pool_size: int = Field(default=10, ge=1, le=1000)
    # Start on a schema migrated by a newer statestore (migrations are additive): rolling upgrades and rollbacks.
    allow_newer_schema: bool = True
    # Bounds every database wait (connect, statement, pool checkout): a hung database fails turns with 503.
    database_timeout_seconds: float = Field(default=5.0, gt=0)
    redis_url: str | None = None
    redis_prefix: str = Field(default="ss:", min_length=1, max_length=64)
    upstream_url: str = "https://api.anthropic.com"
    # The Chat Completions backend behind the Responses front door (docs/responses.md); unset, those routes answer 400.
    chat_upstream_url: str | None = None
    upstream_connect_timeout: float = Field(default=10.0, gt=0)
    # Generous: a long extended-thinking stream can be silent between events for minutes.
    upstream_read_timeout: float = Field(default=600.0, gt=0)
    upstream_max_connections: int = Field(default=200, ge=1)
    # How long a request waits for one of those connections to come free (a turn holds its lease meanwhile); then 503.
    upstream_pool_timeout_seconds: float = Field(default=30.0, gt=0)
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    # WebSocket mode on /v1/responses (docs/responses.md): how long one connection may stay open, and how often an idle
    # one is pinged (an unanswered ping closes it after as long again). A message is limited as a body is.
    socket_max_seconds: float = Field(default=3600.0, gt=0)
    socket_ping_seconds: float = Field(default=20.0, gt=0)
    # The chain context those connections hold, together, in one process: each holds its last chain head's, so that a
    # continue from it reads none from Redis (a head may be as large as a thread, 64 MiB by default). Past this, a
    # connection holds none and its continue reads as over HTTP. A `store: false` response is held whatever this says.
    socket_held_bytes: int = Field(default=256 * 1024 * 1024, ge=0)
    # permessage-deflate on those connections when a client offers it (the SDKs do): off, as the streamed HTTP door
    # sends its events uncompressed; on, every event is compressed (zlib), about a sixth more CPU a socket turn.
    socket_compression: bool = False

    auth_mode: Literal["passthrough", "keys"] = "passthrough"
    # Keys the owner hash of a passthrough credential, so a leaked database cannot be used to test credentials.
    owner_secret: SecretStr | None = None

    # The keys that seal a compaction item's summary (`encrypted_content`, docs/responses.md): "id:key,id:key", each key
    # 32 bytes in URL-safe base64, newest first: the first seals, all open. Unset: a key derived from owner_secret.
    compaction_keys: SecretStr | None = None

    # Encryption at rest (docs/encryption.md): master keys "id:key,id:key" (32 bytes each, URL-safe base64,
    # newest first), inline or in a file; unset, content is stored in clear. The wrapped data keys live in the content
    # database unless keystore_url names another one. Unwrapped data keys are remembered this long per replica.
    encryption_keys: SecretStr | None = None
    encryption_keys_file: Path | None = None
    keystore_url: str | None = None
    # An erasure waits this long (and the database timeout) after destroying keys, so it also takes what replicas sealed
    # under them meanwhile.
    data_key_cache_seconds: float = Field(default=10.0, ge=0, le=600)

    default_ttl_seconds: int = Field(default=300, ge=1)
    max_ttl_seconds: int = Field(default=86_400, ge=1)
    max_thread_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    max_messages: int = Field(default=100_000, ge=1)
    threads_enabled: bool = True
    sessions_enabled: bool = True
    # How long a continue holds the thread head when its request dies without releasing it.
    lease_seconds: int = Field(default=120, ge=1)
    # A continue by response id claims the head in Redis, not with a lease in PostgreSQL, where Redis (standalone, in
    # clear) and PostgreSQL are both configured: one database round trip a turn fewer (docs/architecture.md, "Who may
    # continue"). With Redis (standalone, in clear), a continue by previous_response_id reads the previous response's
    # row from beside the chain's cached context (docs/architecture.md, "Who may continue").
    redis_claims: bool = True

    # keys mode: the backend credential statestore sends, globally or per tenant name (JSON object).
    upstream_api_key: SecretStr | None = None
    tenant_upstream_keys: dict[str, SecretStr] = Field(default_factory=dict)
    # How long a statestore API key lookup is remembered; a revocation through this process applies at once.
    key_cache_seconds: float = Field(default=5.0, ge=0)
    # Admin API bearer tokens, "name:token" entries separated by commas; the name is the audit log's actor.
    admin_tokens: SecretStr | None = None
    policy_cache_seconds: float = Field(default=5.0, ge=0)
    # The console's sign-in throttle, per 15-minute window: failed attempts from one client address, and sign-ins with
    # one admin token (by its name).
    console_sign_in_failures: int = Field(default=10, ge=1)
    console_sign_ins_per_token: int = Field(default=30, ge=1)

    # Background responses (docs/responses.md): how many this replica runs at once (more wait queued for any replica),
    # how often it looks for queued turns and for turns whose replica stopped, and how many events a turn's stream
    # keeps.
    background_workers: int = Field(default=32, ge=0, le=10_000)
    background_poll_seconds: float = Field(default=1.0, gt=0, le=60)
    background_events_max: int = Field(default=20_000, ge=100)
    # At shutdown, how long running background turns may finish before they are handed back to another replica.
    background_grace_seconds: float = Field(default=10.0, ge=0)

    purge_interval_seconds: float = Field(default=60.0, gt=0)
    purge_batch_size: int = Field(default=500, ge=1, le=100_000)
    # Tests only: a file holding seconds to add to the wall clock, read on every clock call.
    clock_offset_file: Path | None = None

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_json: bool = True

    @field_validator("upstream_url")
    @classmethod
    def _upstream_is_http(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")

    @field_validator("chat_upstream_url")
    @classmethod
    def _chat_upstream_is_http(cls, value: str | None) -> str | None:
        if value in (None, ""):
            return None
        assert value is not None
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")

    @field_validator("compaction_keys")
    @classmethod
    def _compaction_keys_parse(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value().strip():
            return None
        parse_keys(value.get_secret_value())  # refused at start-up, not at the first compaction
        return value

    @field_validator("keystore_url")
    @classmethod
    def _keystore_driver(cls, value: str | None) -> str | None:
        return cls._async_driver(value) if value else None

    @field_validator("database_url")
    @classmethod
    def _async_driver(cls, value: str) -> str:
        # Accept the plain scheme people copy from elsewhere and pick the async driver we ship.
        if value.startswith(("postgresql://", "postgres://")):
            return "postgresql+asyncpg://" + value.split("://", 1)[1]
        if value.startswith("sqlite:///"):
            return "sqlite+aiosqlite:///" + value.removeprefix("sqlite:///")
        if not value.startswith(("postgresql+asyncpg://", "sqlite+aiosqlite://")):
            raise ValueError("must be a postgresql:// or sqlite:/// URL")
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        if value in (None, ""):
            return None
        assert value is not None
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        url, cluster = split_cluster_flag(value)
        # What the client accepts, checked at start-up rather than at the first turn.
        endpoint = parse_url(url)
        if cluster and (endpoint.path is not None or endpoint.db):
            raise ValueError("a redis cluster is reached over TCP and has only database 0")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.default_ttl_seconds > self.max_ttl_seconds:
            raise ValueError("STATESTORE_DEFAULT_TTL_SECONDS must not exceed STATESTORE_MAX_TTL_SECONDS")
        short = [name for token, name in self.admin_token_table().items() if len(token) < 16]
        if short:
            raise ValueError(f"STATESTORE_ADMIN_TOKENS: tokens must be at least 16 characters ({', '.join(short)})")
        self.master_keys()  # a malformed ring is refused at start-up, naming the entry, never the key
        return self

    def master_keys(self) -> MasterKeyRing | None:
        """The master key ring, or None when encryption at rest is off."""
        inline = self.encryption_keys.get_secret_value() if self.encryption_keys else None
        return read_master_keys(inline, self.encryption_keys_file)

    def serving_problem(self) -> str | None:
        """A reason the server must not start with these settings, or None. (Not a validator: the CLI's other
        commands run without what only serving needs.)"""
        if self.auth_mode == "passthrough":
            secret = self.owner_secret.get_secret_value() if self.owner_secret else ""
            if len(secret) < 16:
                return (
                    "STATESTORE_OWNER_SECRET must be set to a random string of at least 16 characters: it keys the "
                    "hash that ties each thread to its credential. Generate one with\n"
                    "  python3 -c 'import secrets; print(secrets.token_urlsafe(32))'\n"
                    "and keep it: changing it hides every existing thread from its owner."
                )
        elif self.upstream_api_key is None and not self.tenant_upstream_keys:
            return (
                "keys mode needs the backend credential: set STATESTORE_UPSTREAM_API_KEY, or "
                'STATESTORE_TENANT_UPSTREAM_KEYS=\'{"tenant-name": "key", ...}\''
            )
        return None

    def admin_token_table(self) -> dict[str, str]:
        """Admin token → its name. Entries are "name:token"; a bare token is named "admin"."""
        table: dict[str, str] = {}
        raw = self.admin_tokens.get_secret_value() if self.admin_tokens else ""
        for entry in filter(None, (part.strip() for part in raw.split(","))):
            name, _, token = entry.rpartition(":")
            table[token] = name or "admin"
        return table
