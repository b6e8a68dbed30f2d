"""``GET /sessions`` lists summaries in pages bounded in bytes, however big the sessions are.

Fifty sessions with long token histories and as much metadata as a request
body allows: a page never carries a token id, stays under the byte budget,
and paging still hands out every session exactly once.
"""

from __future__ import annotations

import json

from chatsvc.api.native.sessions import LIST_PAGE_MAX_BYTES
from chatsvc.store.records import MessageRecord
from tests.api.conftest import ACME_KEY, new_session

NUM_SESSIONS = 50
HISTORY_TOKENS = 20_000
# Close to what the test server's 64 KB body limit lets one create request carry.
BIG_METADATA = {f"field-{i:02d}": "m" * 4000 for i in range(14)}


async def _long_history(store, tenant_id: str, session_id: str) -> None:
    tokens = [(7 * i) % 49_152 for i in range(HISTORY_TOKENS)]
    async with store.sessions.turn_lock(tenant_id, session_id) as lock:
        session = await store.sessions.peek(tenant_id, session_id)
        await store.branches.commit_turn(
            tenant_id,
            session_id,
            parent_id=session.active_leaf,
            inputs=[MessageRecord(role="user", text="long question", token_ids=[])],
            output=MessageRecord(role="assistant", text="long answer", token_ids=tokens[-10:]),
            prompt_token_ids=tokens[:-10],
            lock=lock,
        )


def test_listing_pages_are_summaries_under_the_byte_budget(api, acme):
    store = api.services.store
    tenant_id = api.services.tenants.tenant_for_key(ACME_KEY).id
    ids = []
    try:
        for _ in range(NUM_SESSIONS):
            sid = new_session(acme, metadata=BIG_METADATA)["id"]
            api.call(_long_history(store, tenant_id, sid))
            ids.append(sid)

        seen: list[str] = []
        bodies: list[bytes] = []
        cursor = None
        while True:
            params = {"limit": 500} | ({} if cursor is None else {"cursor": cursor})
            response = acme.get("/sessions", params=params)
            assert response.status_code == 200, response.text
            bodies.append(response.content)
            page = response.json()
            seen.extend(s["id"] for s in page["sessions"])
            cursor = page["next_cursor"]
            if cursor is None:
                break

        assert all(len(body) < LIST_PAGE_MAX_BYTES for body in bodies), [len(b) for b in bodies]
        mine = [sid for sid in seen if sid in set(ids)]
        assert sorted(mine) == sorted(ids) and len(seen) == len(set(seen))
        for body in bodies:
            for summary in json.loads(body)["sessions"]:
                assert "token_ids" not in summary and "messages" not in summary
        first = json.loads(bodies[0])["sessions"][0]
        assert first["id"] == ids[-1] and first["metadata"] == BIG_METADATA
        assert first["num_tokens"] == HISTORY_TOKENS and first["num_messages"] == 2
        assert len(bodies) >= 3  # the byte budget, not the limit of 500, ended the pages
    finally:
        for sid in ids:
            acme.delete(f"/sessions/{sid}")
