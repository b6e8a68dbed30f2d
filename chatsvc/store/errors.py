"""Exceptions raised by the session store.

Every store method that fails leaves Redis unchanged; the exception says why.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class InvalidInputError(StoreError, ValueError):
    """An argument is malformed: an id, a name, a cursor, metadata, a record to keep.

    Raised before anything is read or written; the message names the field and is
    safe to show to the client. Any other ValueError out of the store (a record in
    Redis that does not decode, say) is a failure of ours, not bad input.
    """


class InvalidInputTypeError(InvalidInputError, TypeError):
    """An argument has the wrong type."""


class MalformedIdError(InvalidInputError):
    """An id does not have the shape of any id, so it names nothing.

    Callers may answer it as they answer an unknown id (404); every other
    ``InvalidInputError`` is bad input of another kind (400) and must not be.
    """


class StoreUnavailableError(StoreError):
    """Redis could not be reached or did not answer within the socket timeout."""


class UnconfirmedWriteError(StoreUnavailableError):
    """A write (MULTI/EXEC or script) ran on the primary; too few replicas confirmed it in time.

    Unlike the other outages, the write may well be stored (on the primary, and on
    any replica that got it later): a caller must not be told it was not.
    """


class SessionBusyError(StoreError):
    """Another turn holds the session's turn lock (the API answers 409)."""


class LimitExceededError(StoreError):
    """A create would pass a configured cap (the API answers 429); nothing was written."""


class StorageQuotaError(LimitExceededError):
    """A write would take a session's or a tenant's stored bytes past its quota (the
    API answers 429 with this message, which names the limit); nothing was written."""


class TurnLockLostError(StoreError):
    """A turn's commit was refused: its turn lock expired and was (or may be) taken
    by another turn, so writing now could interleave two turns (nothing was written)."""


class NotFoundError(StoreError, LookupError):
    """A tenant, system prompt or session is unknown to the caller.

    Another tenant's id raises this too, with the same message shape, so the
    error never reveals that the id exists elsewhere.
    """


class SchemaVersionError(StoreError):
    """The keyspace was written by a newer chatsvc than this one."""
