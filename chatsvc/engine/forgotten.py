"""Sessions deleted lately, and their sequences whose KV is forgotten once they let go.

``forget_session`` forgets what a session's sequences hold at that moment, but
two kinds of sequence outlive it: one aborted while its disk loads run (it
keeps its blocks until they land), and one whose request reaches the engine
just after the delete (its turn began before it). Both compute or hold blocks
tagged with the deleted session. The engine records the session's owner digest
here before it aborts anything; every sequence of such an owner that finishes
is kept in ``waiting`` until the cache has freed it, then its whole token chain
is forgotten like the session's (``LLMEngine.forget_late``).

Bounded: the newest ``MAX_SESSIONS`` deleted owners. Session ids are random
and never reused, so an owner here never names a live session; a request
arriving later than that many deletes after its own is not caught.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_SESSIONS = 4096


class ForgottenSessions:
    """Owner digests of deleted sessions, and their finished sequences still held."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._owners: OrderedDict[bytes, None] = OrderedDict()
        self.waiting: list = []  # engine Sequences whose blocks the cache still holds

    def __contains__(self, owner: bytes) -> bool:
        return bool(owner) and owner in self._owners

    def add(self, owner: bytes) -> None:
        self._owners[owner] = None
        self._owners.move_to_end(owner)
        while len(self._owners) > self.max_sessions:
            self._owners.popitem(last=False)

    def finished(self, seq) -> None:
        """A sequence ended: keep it to forget if its session was deleted."""
        if seq.cache_owner in self:
            self.waiting.append(seq)

    def take_freed(self, is_held) -> list:
        """The waiting sequences the cache no longer holds (``is_held(seq_id)`` False)."""
        freed = [seq for seq in self.waiting if not is_held(seq.seq_id)]
        if freed:
            self.waiting = [seq for seq in self.waiting if is_held(seq.seq_id)]
        return freed
