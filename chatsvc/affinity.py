"""Affinity misses: turns whose history this replica had to recompute because it never held it.

With several replicas behind a load balancer that hashes on the session, a
session's turns should all land on one replica, whose prefix cache then holds
the whole conversation. When the session moves (a replica died, the ring was
rebalanced, a client bypassed the hash), the new replica rebuilds the KV from
the token ids stored in Redis: correct, but it pays the whole history again.
This module tells that cost apart from an ordinary eviction.

Definitions (B = the KV block size; per replica, per stored turn):

- a **history turn** is a turn of a session that already holds at least one
  stored turn, whose prompt extends the stored token ids (the chat template
  kept the history as a prefix; re-rendered turns are counted as lost reuse
  elsewhere);
- its **reusable history** is the stored tokens in full blocks, short of the
  last stored token (the previous answer's last token was sampled, never fed
  back, so no replica holds its KV) and of the last prompt token:
  ``min(len(stored) - 1, len(prompt) - 1) // B * B``;
- it **recomputed history** when the prefix cache served at least one full
  block less than that: ``reusable - cached >= B``;
- it is an **affinity miss** when it recomputed history and this replica had
  not computed that history itself: the session's stored tokens are more than
  this replica last wrote for it (its previous turns ran elsewhere), or the
  replica never served it (since it started, within the memory below);
- otherwise a recomputing history turn is an **eviction**: this replica did
  compute the history and has since dropped it for room.

The memory of which sessions this replica computed is bounded (LRU,
``max_sessions``); a session forgotten there whose KV was also evicted counts
as a miss, which is what it costs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

RESIDENT = "resident"
EVICTED = "evicted"
AFFINITY_MISS = "affinity_miss"


@dataclass(frozen=True)
class HistoryTurn:
    """What the tracker needs of one stored turn."""

    session_id: str
    stored_tokens: int  # the session's token history before this turn
    prior_turns: bool  # the session had at least one stored turn before this one
    extends_history: bool  # the prompt is the stored tokens plus the new turn's
    prompt_tokens: int
    cached_tokens: int  # served from this replica's prefix cache
    tokens_after: int  # the session's token history once this turn is stored


@dataclass(frozen=True)
class Verdict:
    """``kind``: RESIDENT, EVICTED or AFFINITY_MISS; ``recomputed_tokens``: history paid again."""

    kind: str
    recomputed_tokens: int


class AffinityTracker:
    """Classifies this replica's history turns; one per process, on the event loop's thread."""

    def __init__(self, max_sessions: int = 65_536) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        # session id -> length of the token history this replica last computed for it
        self._computed: OrderedDict[str, int] = OrderedDict()
        self._counts = {RESIDENT: 0, EVICTED: 0, AFFINITY_MISS: 0}
        self._recomputed = {EVICTED: 0, AFFINITY_MISS: 0}

    def observe(self, turn: HistoryTurn, block_size: int) -> Verdict | None:
        """Classify a stored turn (None: not a history turn) and remember what it computed."""
        verdict = self._classify(turn, block_size)
        self._computed[turn.session_id] = turn.tokens_after
        self._computed.move_to_end(turn.session_id)
        while len(self._computed) > self.max_sessions:
            self._computed.popitem(last=False)
        if verdict is not None:
            self._counts[verdict.kind] += 1
            if verdict.kind != RESIDENT:
                self._recomputed[verdict.kind] += verdict.recomputed_tokens
        return verdict

    def _classify(self, turn: HistoryTurn, block_size: int) -> Verdict | None:
        if not (turn.prior_turns and turn.extends_history) or turn.prompt_tokens < 1:
            return None
        reusable = min(turn.stored_tokens - 1, turn.prompt_tokens - 1) // block_size * block_size
        recomputed = max(0, reusable - turn.cached_tokens)
        if recomputed < block_size:
            return Verdict(RESIDENT, 0)
        computed_here = self._computed.get(turn.session_id, -1)
        kind = EVICTED if computed_here >= turn.stored_tokens else AFFINITY_MISS
        return Verdict(kind, recomputed)

    def snapshot(self) -> dict[str, Any]:
        """Counts for /admin/cache (JSON-able)."""
        turns = sum(self._counts.values())
        misses = self._counts[AFFINITY_MISS]
        return {
            "history_turns": turns,
            "kv_resident_turns": self._counts[RESIDENT],
            "affinity_misses": misses,
            "evicted_history_turns": self._counts[EVICTED],
            "affinity_miss_rate": misses / turns if turns else 0.0,
            "recomputed_tokens": dict(self._recomputed),
            "sessions_remembered": len(self._computed),
        }


def record_turn(services: Any, turn: Any, metrics: Any, completion_tokens: int) -> None:
    """Feed one stored turn (chatsvc.api.turn.prompt.PreparedTurn) to the tracker and metrics."""
    context = turn.context
    prompt = turn.request.prompt_token_ids
    history = HistoryTurn(
        session_id=turn.session_id,
        stored_tokens=len(context.tokens),
        # the branch it continues holds an answer: a turn was stored before this one
        prior_turns=any(m.role == "assistant" for m in context.messages),
        extends_history=turn.reused,
        prompt_tokens=len(prompt),
        cached_tokens=metrics.cached_prompt_tokens,
        tokens_after=len(prompt) + completion_tokens,
    )
    verdict = services.affinity.observe(history, services.engine.info.block_size)
    if verdict is not None:
        services.metrics.observe_history_turn(verdict.kind, verdict.recomputed_tokens)
