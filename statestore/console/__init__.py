"""The admin console at /admin/console: server-rendered pages over the same AdminService as `/admin/v1` and
`statestore admin`, with every asset in the package. Off unless STATESTORE_ADMIN_TOKENS is set."""

from statestore.console import overview, records, tenants
from statestore.console.web import router

__all__ = ["overview", "records", "router", "tenants"]
