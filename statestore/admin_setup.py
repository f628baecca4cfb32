"""The admin's services, wired by one function for the server (statestore/resources.py, whose doors share the policy
store, the authenticator and the idempotency store made here) and for `statestore admin` (statestore/admin_cli.py).
Apart from resources.py so that an admin command imports and builds only these: not the doors, the backend clients or
the metrics."""

from __future__ import annotations

from dataclasses import dataclass

from statestore.admin import AdminService
from statestore.auth import Authenticator, KeysAuthenticator, PassthroughAuthenticator
from statestore.config import Settings
from statestore.erasure_runs import ErasureRuns
from statestore.policy import Policy
from statestore.retention import Retention
from statestore.storage_setup import Storage
from statestore.store.admin_repository import AdminRepository
from statestore.store.erasure_log import ErasureLog
from statestore.store.idempotency_store import IdempotencyStore
from statestore.store.retention_queries import RetentionQueries
from statestore.threads.policy_store import PolicyStore


@dataclass(frozen=True, slots=True)
class AdminSetup:
    repository: AdminRepository
    policies: PolicyStore
    authenticator: Authenticator
    # Writes sent with an Idempotency-Key: the doors store them, the purger deletes the expired ones.
    idempotency_store: IdempotencyStore
    retention: Retention
    admin: AdminService


def build_authenticator(settings: Settings, admin: AdminRepository) -> Authenticator:
    if settings.auth_mode == "keys":
        return KeysAuthenticator(
            admin,
            upstream_key=settings.upstream_api_key.get_secret_value() if settings.upstream_api_key else None,
            tenant_upstream_keys={k: v.get_secret_value() for k, v in settings.tenant_upstream_keys.items()},
            cache_seconds=settings.key_cache_seconds,
        )
    secret = settings.owner_secret.get_secret_value().encode() if settings.owner_secret else b""
    return PassthroughAuthenticator(secret)


def build_admin(settings: Settings, storage: Storage, *, serving: bool) -> AdminSetup:
    """`serving=False` (the admin CLI): the policy cache off, so each command reads what is stored now."""
    repository = AdminRepository(storage.engine)
    policies = PolicyStore(
        repository,
        fallback=Policy.from_settings(settings),
        cache_seconds=settings.policy_cache_seconds if serving else 0,
    )
    authenticator = build_authenticator(settings, repository)
    idempotency_store = IdempotencyStore(storage.engine, storage.content)
    retention = Retention(
        queries=RetentionQueries(storage.engine),
        admin=repository,
        cache=storage.cache,
        clock=storage.clock,
        batch_size=settings.purge_batch_size,
        content=storage.content,
        idempotency=idempotency_store,
    )
    admin = AdminService(
        repository=repository,
        policies=policies,
        retention=retention,
        authenticator=authenticator,
        clock=storage.clock,
        erasures=ErasureRuns(
            ErasureLog(repository.engine), retention, clock=storage.clock, lease_seconds=settings.lease_seconds
        ),
    )
    return AdminSetup(
        repository=repository,
        policies=policies,
        authenticator=authenticator,
        idempotency_store=idempotency_store,
        retention=retention,
        admin=admin,
    )
