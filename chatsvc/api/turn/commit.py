"""A finished turn into the store: the answer's record, then one fenced, idempotent write.

The write holds the new messages, the answer, the token history and the active
branch at once, and only while the turn still holds the session's turn lock
(``Branches.commit_turn``); a first response creates its session with them instead.
"""

from __future__ import annotations

import anyio
import msgspec

from chatsvc.api.shared.errors import ConflictError, RateLimitError
from chatsvc.api.shared.generation import SampleResult
from chatsvc.api.shared.rendering import format_chat
from chatsvc.api.turn.prompt import PreparedTurn
from chatsvc.service import Services
from chatsvc.store import TurnLockLostError
from chatsvc.store.errors import LimitExceededError, StorageQuotaError
from chatsvc.store.lock import RedisLock
from chatsvc.store.records import MessageRecord, ResponseRecord, TenantRecord
from chatsvc.store.records import Usage as UsageRecord


async def answer_record(
    services: Services, turn: PreparedTurn, sample: SampleResult
) -> MessageRecord:
    """The assistant message to store for a finished sample."""
    m = sample.metrics
    # Text and tokens stored must agree (a stop string cuts the text, not the tokens),
    # or the next turn's render no longer extends the stored tokens.
    answer_ids = await format_chat(
        services.engine.chat_format.answer_token_ids,
        turn.request.prompt_token_ids,
        sample.token_ids,
        sample.text,
    )
    return MessageRecord(
        role="assistant",
        text=sample.text,
        token_ids=answer_ids,
        usage=UsageRecord(
            prompt_tokens=m.prompt_tokens,
            cached_tokens=m.cached_prompt_tokens,
            completion_tokens=m.completion_tokens,
            ttft_s=m.ttft_s,
        ),
        id=turn.output_id,
        parent_id=turn.inputs[-1].id if turn.inputs else turn.context.parent_id,
    )


async def commit_turn(
    services: Services,
    tenant: TenantRecord,
    turn: PreparedTurn,
    output: MessageRecord,
    record: ResponseRecord | None,
    lock: RedisLock | None,
) -> None:
    """Store the turn; 409 ``turn_lock_lost`` when the lock expired while it ran, 429
    when the session's messages (or a new session, the tenant's sessions) would pass
    their cap, or its bytes a storage quota."""
    store = services.store
    # Shielded so a disconnect arriving during the write cannot cut its round trip in
    # half; the write itself is all-or-nothing in Redis either way. The request id
    # names the turn: a commit resent after a lost reply is then recognised as
    # already applied instead of storing the turn twice.
    try:
        with anyio.CancelScope(shield=True):
            if turn.new_session:
                # A new session's history starts with this prompt, carried by the last
                # input (the earlier ones are rendered in it).
                inputs = list(turn.inputs)
                inputs[-1] = msgspec.structs.replace(
                    inputs[-1], token_ids=list(turn.request.prompt_token_ids)
                )
                await store.sessions.create(
                    tenant.id,
                    None,
                    None,
                    None,
                    None if record is None else record.metadata,
                    messages=[*inputs, output],
                    kind="response",
                    response=record,
                    session_id=turn.session_id,
                    max_sessions=services.settings.limits.max_sessions_per_tenant,
                )
            else:
                await store.branches.commit_turn(
                    tenant.id,
                    turn.session_id,
                    parent_id=turn.context.parent_id,
                    inputs=turn.inputs,
                    output=output,
                    prompt_token_ids=turn.request.prompt_token_ids,
                    lock=lock,
                    turn_id=turn.request.request_id,
                    response=record,
                    max_nodes=services.settings.limits.max_messages_per_session,
                )
    except TurnLockLostError:
        services.metrics.observe_failure(turn.spec.endpoint, "lock_lost")
        raise ConflictError(
            "the session's turn lock expired while this turn ran (a stall or a Redis "
            "failover longer than its TTL) and another turn may have taken over; "
            "this turn was not stored, send the message again",
            error_type="turn_lock_lost",
        ) from None
    except StorageQuotaError as exc:
        raise RateLimitError(
            f"{exc}; the turn was not stored, delete some sessions or branches first"
        ) from None
    except LimitExceededError as exc:
        what = "sessions" if turn.new_session else "of its branches"
        raise RateLimitError(f"{exc}; delete some {what} first") from None
