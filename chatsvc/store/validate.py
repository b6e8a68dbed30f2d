"""Checks on caller input, run before anything is written.

Each raises ``ValueError`` (or ``TypeError`` for a wrong type) with a message
that names the offending field, so the API can hand it to the client as a 4xx.
"""

from __future__ import annotations

from collections.abc import Sequence

from chatsvc.store.records import ROLES, MessageRecord

MAX_METADATA_ITEMS = 64
MAX_METADATA_KEY_CHARS = 128
MAX_METADATA_VALUE_CHARS = 4096
MAX_NAME_CHARS = 200
MIN_API_KEY_CHARS = 16


def check_text(field: str, value: object, *, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise ValueError(f"{field} must not be empty")
    return value


def check_name(field: str, value: object) -> str:
    check_text(field, value, allow_empty=False)
    if len(value) > MAX_NAME_CHARS:
        raise ValueError(f"{field} is longer than {MAX_NAME_CHARS} characters")
    return value


def check_token_ids(field: str, value: object) -> list[int]:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise TypeError(f"{field} must be a list of ints, got {type(value).__name__}")
    tokens = list(value)
    for token in tokens:
        # bool is an int subclass; a True among token ids is a caller bug.
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ValueError(f"{field} must hold non-negative ints, found {token!r}")
    return tokens


def check_metadata(value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"metadata must be a dict[str, str], got {type(value).__name__}")
    if len(value) > MAX_METADATA_ITEMS:
        raise ValueError(f"metadata has more than {MAX_METADATA_ITEMS} entries")
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise TypeError(f"metadata must map str to str, found {key!r}: {item!r}")
        if len(key) > MAX_METADATA_KEY_CHARS or len(item) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"metadata entry {key[:40]!r} is too long")
    return dict(value)


def check_message(field: str, message: object, role: str) -> MessageRecord:
    if not isinstance(message, MessageRecord):
        raise TypeError(f"{field} must be a MessageRecord, got {type(message).__name__}")
    if message.role != role or role not in ROLES:
        raise ValueError(f"{field}.role must be {role!r}, got {message.role!r}")
    check_text(f"{field}.text", message.text)
    check_token_ids(f"{field}.token_ids", message.token_ids)
    return message


def check_api_key(api_key: object) -> str:
    check_text("api_key", api_key, allow_empty=False)
    if len(api_key) < MIN_API_KEY_CHARS:
        # The key is stored as a plain sha256; that is only safe for keys with
        # enough entropy that guessing is hopeless (see docs/store.md).
        raise ValueError(f"api_key must be at least {MIN_API_KEY_CHARS} characters")
    return api_key
