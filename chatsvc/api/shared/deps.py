"""Names of the injected dependencies, marked explicitly for Litestar's resolver."""

from __future__ import annotations

from litestar.di import NamedDependency

from chatsvc.service import Services
from chatsvc.store.records import TenantRecord

# Provided by the app: the running services (store, engine, metrics) and the
# calling tenant (chatsvc.api.auth.provide_tenant).
ServicesDep = NamedDependency[Services]
TenantDep = NamedDependency[TenantRecord]
