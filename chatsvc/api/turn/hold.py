"""What a running turn holds: the session's turn lock (stored turns) and a generation slot."""

from __future__ import annotations

import anyio

from chatsvc.api.shared.generation import StreamSlot
from chatsvc.service import Services
from chatsvc.store.lock import RedisLock


class TurnHold:
    """The turn lock (if any) and the generation slot of one turn; ``release`` is idempotent.

    ``lock`` is what the turn's commit is fenced by (see ``Branches.commit_turn``).
    """

    def __init__(self, slot: StreamSlot, lock_cm=None, lock: RedisLock | None = None) -> None:
        self._slot = slot
        self._lock_cm = lock_cm
        self.lock = lock
        self._released = False

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            if self._lock_cm is not None:
                # Shielded: on a client disconnect this runs inside a cancelled scope,
                # and an unshielded await would leave the lock held until its TTL.
                with anyio.CancelScope(shield=True):
                    await self._lock_cm.__aexit__(None, None, None)
        finally:
            self._slot.release()


async def take_hold(
    services: Services, tenant_id: str, session_id: str | None, locked: bool
) -> TurnHold:
    """The session's turn lock when ``locked`` (409 while another turn runs), then a slot
    (429 over the tenant's limit); on a failure nothing stays held."""
    if not locked:
        return TurnHold(StreamSlot(services, tenant_id))
    # The lock comes before the slot: clients racing on one session get 409 and
    # never hold one of the tenant's generation slots while they lose the race.
    lock_cm = services.store.sessions.turn_lock(tenant_id, session_id)
    lock = await lock_cm.__aenter__()
    try:
        slot = StreamSlot(services, tenant_id)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await lock_cm.__aexit__(None, None, None)
        raise
    return TurnHold(slot, lock_cm, lock)
