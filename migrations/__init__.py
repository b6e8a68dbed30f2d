"""Versioned keyspace migrations: data the store applies (``chatsvc.store.schema``).

Each ``m000N_<name>.py`` defines ``VERSION`` (N), ``NAME`` and
``async up(client, keys)``, where ``client`` is a redis-py asyncio client and
``keys`` the store's key names for the prefix (``keyspace.KeyNames``). ``up`` must
be idempotent: one interrupted half way runs again from the start.

A migration describes the record layouts it reads and writes itself, as they
were at its version: it imports nothing from chatsvc, so later changes to the
store's records cannot change what an old migration does, and the store may
import this package without a cycle.
"""

from migrations import (
    m0001_initial,
    m0002_session_index_zset,
    m0003_tenant_names_and_operator_prompts,
    m0004_session_tokens_key,
    m0005_message_tree,
    m0006_storage_bytes,
)

# Oldest first; the store's SCHEMA_VERSION is the last one's VERSION.
MIGRATIONS = (
    m0001_initial,
    m0002_session_index_zset,
    m0003_tenant_names_and_operator_prompts,
    m0004_session_tokens_key,
    m0005_message_tree,
    m0006_storage_bytes,
)
