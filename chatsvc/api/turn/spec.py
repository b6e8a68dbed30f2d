"""What a turn is asked to add (``TurnSpec``) and what it produced (``StoredTurn``)."""

from __future__ import annotations

from dataclasses import dataclass

from chatsvc.api.shared.generation import SampleResult
from chatsvc.store.records import MessageRecord


@dataclass(frozen=True)
class TurnSpec:
    """What a turn adds and where.

    ``inputs``: (role, text) of the new messages, oldest first; none with
    ``regenerate``. ``parent_id``: the message they follow (None: the active
    branch's last; ``ROOT``: the top level). ``regenerate``: answer a user message
    again (``parent_id`` names it, or the active branch's last user message).
    ``store`` False writes nothing (no lock, no session made).
    """

    inputs: tuple[tuple[str, str], ...] = ()
    parent_id: str | None = None
    regenerate: bool = False
    instructions: str | None = None
    store: bool = True
    endpoint: str = "session_turn"


@dataclass
class StoredTurn:
    """A finished turn: what the model produced and, when stored, what was stored."""

    session_id: str
    inputs: list[MessageRecord]
    output: MessageRecord
    sample: SampleResult
    reused: bool
    stored: bool
