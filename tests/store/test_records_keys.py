from __future__ import annotations

import msgspec
import pytest

from chatsvc.store.keys import Keys, check_id
from chatsvc.store.records import (
    MessageRecord,
    SessionRecord,
    SessionSummary,
    Usage,
    decode,
    decode_tokens,
    encode,
    encode_tokens,
)


def test_records_round_trip_through_msgpack():
    message = MessageRecord(
        role="assistant",
        text="héllo",
        token_ids=[1, 2, 3],
        created_at=5.0,
        usage=Usage(prompt_tokens=9, cached_tokens=4, completion_tokens=3, ttft_s=0.2),
    )
    assert decode(MessageRecord, encode(message)) == message


def test_old_record_without_newer_fields_still_decodes():
    # Maps, not arrays: a record written before a defaulted field existed decodes.
    old = msgspec.msgpack.encode(
        {
            "id": "s",
            "tenant_id": "t",
            "system_prompt_id": None,
            "metadata": {},
            "created_at": 1.0,
            "updated_at": 2.0,
        }
    )
    session = decode(SessionRecord, old)
    assert session.token_ids == [] and session.num_messages == 0


def test_a_record_splits_into_its_summary_and_token_history_and_back():
    record = SessionRecord(
        id="s",
        tenant_id="t",
        system_prompt_id="p",
        metadata={"k": "v"},
        created_at=1.0,
        updated_at=2.0,
        num_messages=3,
        token_ids=[5, 70_000, 0],
    )
    summary = decode(SessionSummary, encode(record.summary()))
    assert summary.num_tokens == 3 and not hasattr(summary, "token_ids")
    tokens = decode_tokens(encode_tokens(record.token_ids))
    assert SessionRecord.from_summary(summary, tokens) == record


def test_corrupt_record_raises():
    with pytest.raises(msgspec.ValidationError):
        decode(MessageRecord, msgspec.msgpack.encode({"role": "user"}))


def test_every_session_key_carries_the_session_hash_tag():
    keys = Keys("pfx")
    session_keys = keys.session_keys("abc")
    assert len(set(session_keys)) == 9  # layout 5: the tree keys, and the old list for delete
    assert all(k.startswith("pfx:") and "{abc}" in k for k in session_keys)
    assert set(keys.session_data_keys("abc")) < set(session_keys)


@pytest.mark.parametrize("bad", ["", "a:b", "a*", "x" * 65, "a b", "{a}", None, 5])
def test_malformed_ids_and_prefixes_are_refused(bad):
    with pytest.raises(ValueError, match="malformed"):
        check_id("session", bad)
    with pytest.raises(ValueError, match="prefix"):
        Keys(bad)
