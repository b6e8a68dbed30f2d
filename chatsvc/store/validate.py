"""Checks on caller input, run before anything is written.

Each raises ``InvalidInputError`` (``InvalidInputTypeError`` for a wrong type;
ValueError and TypeError subclasses) with a message that names the offending
field, so the API can hand it to the client as a 4xx.
"""

from __future__ import annotations

from collections.abc import Sequence

from chatsvc.store.errors import InvalidInputError, InvalidInputTypeError
from chatsvc.store.records import ROLES, MessageRecord
from chatsvc.token_ids import first_bad_token_id

MAX_METADATA_ITEMS = 64
MAX_METADATA_KEY_CHARS = 128
MAX_METADATA_VALUE_CHARS = 4096
MAX_NAME_CHARS = 200
MIN_API_KEY_CHARS = 16


def check_text(field: str, value: object, *, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise InvalidInputTypeError(f"{field} must be a str, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise InvalidInputError(f"{field} must not be empty")
    return value


def check_name(field: str, value: object) -> str:
    check_text(field, value, allow_empty=False)
    if len(value) > MAX_NAME_CHARS:
        raise InvalidInputError(f"{field} is longer than {MAX_NAME_CHARS} characters")
    return value


def check_token_ids(field: str, value: object) -> list[int]:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise InvalidInputTypeError(f"{field} must be a list of ints, got {type(value).__name__}")
    tokens = list(value)
    bad = first_bad_token_id(tokens)
    if bad is not None:
        raise InvalidInputError(f"{field} must hold non-negative ints, found {bad.value!r}")
    return tokens


def check_metadata(value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInputTypeError(
            f"metadata must be a dict[str, str], got {type(value).__name__}"
        )
    if len(value) > MAX_METADATA_ITEMS:
        raise InvalidInputError(f"metadata has more than {MAX_METADATA_ITEMS} entries")
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise InvalidInputTypeError(f"metadata must map str to str, found {key!r}: {item!r}")
        if len(key) > MAX_METADATA_KEY_CHARS or len(item) > MAX_METADATA_VALUE_CHARS:
            raise InvalidInputError(f"metadata entry {key[:40]!r} is too long")
    return dict(value)


def check_message(field: str, message: object, role: str) -> MessageRecord:
    if not isinstance(message, MessageRecord):
        raise InvalidInputTypeError(
            f"{field} must be a MessageRecord, got {type(message).__name__}"
        )
    if message.role != role or role not in ROLES:
        raise InvalidInputError(f"{field}.role must be {role!r}, got {message.role!r}")
    check_text(f"{field}.text", message.text)
    check_token_ids(f"{field}.token_ids", message.token_ids)
    return message


def check_api_key(api_key: object) -> str:
    check_text("api_key", api_key, allow_empty=False)
    if len(api_key) < MIN_API_KEY_CHARS:
        # The key is stored as a plain sha256; that is only safe for keys with
        # enough entropy that guessing is hopeless (see docs/store.md).
        raise InvalidInputError(f"api_key must be at least {MIN_API_KEY_CHARS} characters")
    return api_key
