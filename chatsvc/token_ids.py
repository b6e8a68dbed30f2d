"""What a token id is, checked in one place: an int (never a bool) in ``[0, limit)``.

The engine checks prompts against the vocabulary, the chat format checks stored
histories, the store checks what it is asked to keep; each raises its own error
with its own wording, from the first bad id this module finds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class BadTokenId(NamedTuple):
    """The first value of a sequence that is not a token id, and where it stands."""

    position: int
    value: object


def is_token_id(value: object, limit: int | None = None) -> bool:
    """True for an int (bool excluded: it is an int subclass) in ``[0, limit)``
    (``limit`` None: any non-negative int)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return False
    return limit is None or value < limit


def first_bad_token_id(token_ids: Iterable[object], limit: int | None = None) -> BadTokenId | None:
    """The first element that is not a token id below ``limit``; None when all are."""
    for position, value in enumerate(token_ids):
        if not is_token_id(value, limit):
            return BadTokenId(position, value)
    return None
