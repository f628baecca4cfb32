"""The retention policy in force for an owner: the tenant's override, else the stored default, else the one the
settings describe. Read on every threaded turn, so the (small) policy table is kept in memory for a few seconds."""

from __future__ import annotations

import time

from statestore.policy import Policy
from statestore.store.admin_repository import DEFAULT_SCOPE, AdminRepository


class PolicyStore:
    def __init__(self, admin: AdminRepository, *, fallback: Policy, cache_seconds: float) -> None:
        self._admin = admin
        self.fallback = fallback
        self._cache_seconds = cache_seconds
        self._policies: dict[str, Policy] = {}
        self._fresh_until = 0.0

    async def for_tenant(self, tenant_id: str | None) -> Policy:
        now = time.monotonic()
        if now >= self._fresh_until:
            self._policies = await self._admin.all_policies()
            self._fresh_until = now + self._cache_seconds
        if tenant_id is not None and tenant_id in self._policies:
            return self._policies[tenant_id]
        return self._policies.get(DEFAULT_SCOPE, self.fallback)

    def forget(self) -> None:
        """A policy changed through this process: read them again on the next turn."""
        self._fresh_until = 0.0
