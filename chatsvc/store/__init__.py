"""Session store: tenants, system prompts, sessions and turns in Redis.

See docs/store.md for the key layout, the guarantees and the trade-offs.
"""

from chatsvc.store.errors import (
    InvalidInputError,
    NotFoundError,
    SchemaVersionError,
    SessionBusyError,
    StorageQuotaError,
    StoreError,
    StoreUnavailableError,
    TurnLockLostError,
)
from chatsvc.store.store import Store
from chatsvc.store.tenants import hash_api_key

__all__ = [
    "InvalidInputError",
    "NotFoundError",
    "SchemaVersionError",
    "SessionBusyError",
    "StorageQuotaError",
    "Store",
    "StoreError",
    "StoreUnavailableError",
    "TurnLockLostError",
    "hash_api_key",
]
