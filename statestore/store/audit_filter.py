"""Which audit entries to show: by actor, action and tenant (one filter for the API, the CLI and the console)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import or_, select

from statestore.store.schema import api_keys, audit_log


@dataclass(frozen=True, slots=True)
class AuditFilter:
    """Audit entries by who (the admin token's name), what (an action or its prefix: "policy" or "policy.put") and
    which tenant (entries on the tenant, its policy, its keys, and erasures of its threads)."""

    actor: str | None = None
    action: str | None = None
    tenant_id: str | None = None

    def criteria(self) -> list[Any]:
        found: list[Any] = []
        if self.actor:
            found.append(audit_log.c.actor == self.actor)
        if self.action:
            prefix = audit_log.c.action.startswith(self.action + ".", autoescape=True)
            found.append(or_(audit_log.c.action == self.action, prefix))
        if self.tenant_id:
            found.append(
                or_(
                    audit_log.c.target == self.tenant_id,
                    audit_log.c.target.in_(select(api_keys.c.id).where(api_keys.c.tenant_id == self.tenant_id)),
                    audit_log.c.target.startswith(f"tenant={self.tenant_id}", autoescape=True),
                )
            )
        return found
