"""What the client remembers of a conversation, and the check of Redis against it.

Acknowledged turns must be in the stored history, in order, word for word. A
turn that was cut off may or may not be there: the service can die after
the turn's ``commit_turn`` but before the ``done`` event reached the client
("committed, unacknowledged"); such a turn, if stored, must be whole and must be
the turn that was in flight. Nothing else may appear.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chatsvc.store import Store


@dataclass
class Attempt:
    """One turn the client sent; ``answer`` is set when it was acknowledged."""

    user_text: str
    answer: str | None = None

    @property
    def acknowledged(self) -> bool:
        return self.answer is not None


@dataclass
class ConversationLog:
    session_id: str
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def num_acknowledged(self) -> int:
        return sum(a.acknowledged for a in self.attempts)


@dataclass
class Verdict:
    session_id: str
    problems: list[str]
    stored_turns: int
    committed_unacknowledged: int


async def verify(store: Store, tenant_id: str, log: ConversationLog) -> Verdict:
    """Compare the session in Redis with the client's log; an empty ``problems`` is a pass."""
    problems: list[str] = []
    session = await store.sessions.get(tenant_id, log.session_id)
    messages = await store.tree.messages(tenant_id, log.session_id)
    if session is None or messages is None:
        return Verdict(log.session_id, ["session is gone"], 0, 0)
    if session.num_messages != len(messages):
        problems.append(f"num_messages {session.num_messages} != {len(messages)} stored")
    body = messages[1:] if messages and messages[0].role == "system" else messages
    roles = [m.role for m in body]
    if roles != ["user", "assistant"] * (len(body) // 2) or len(body) % 2:
        problems.append(f"roles are not user/assistant pairs: {roles}")
    joined = rebuilt_history(messages)
    if joined != session.token_ids:
        problems.append(
            f"message token ids ({len(joined)}) do not concatenate to the session's "
            f"token history ({len(session.token_ids)})"
        )
    stored = [(body[i].text, body[i + 1].text) for i in range(0, len(body) - 1, 2)]
    extra = _match(stored, log.attempts, problems)
    return Verdict(log.session_id, problems, len(stored), extra)


def rebuilt_history(messages) -> list[int]:
    """The token history the messages imply: their token ids end to end.

    One exception the service makes on purpose: when the chat template does not
    render the stored history as a prefix (e.g. an answer cut inside a
    multi-byte character), the turn re-renders the whole conversation and that
    user message's tokens are the entire prompt. Such a message starts with the
    system message's own tokens, which an appended turn never does.
    """
    head = messages[0].token_ids if messages and messages[0].role == "system" else []
    tokens: list[int] = []
    for m in messages:
        if m.role == "user" and head and tokens and m.token_ids[: len(head)] == head:
            tokens = []
        tokens.extend(m.token_ids)
    return tokens


def _match(stored: list[tuple[str, str]], attempts: list[Attempt], problems: list[str]) -> int:
    """Walk stored turns against attempts in order; return the stored-but-unacked count."""
    extra = 0
    i = 0
    for attempt in attempts:
        here = stored[i] if i < len(stored) else None
        if attempt.acknowledged:
            if here != (attempt.user_text, attempt.answer):
                problems.append(f"acknowledged turn {attempt.user_text!r} missing or altered")
                return extra
            i += 1
        elif here is not None and here[0] == attempt.user_text:
            extra += 1  # the service died between EXEC and the done event
            i += 1
    if i != len(stored):
        problems.append(f"{len(stored) - i} stored turn(s) the client never sent")
    return extra
