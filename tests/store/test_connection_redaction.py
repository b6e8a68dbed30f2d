"""Redis URLs lose their credentials before they reach a log or an error message."""

from __future__ import annotations

import pytest
import redis.exceptions as rexc

from chatsvc.store.connection import redacted, unavailable_on_failure
from chatsvc.store.errors import StoreUnavailableError


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://localhost:6379/0", "redis://localhost:6379/0"),
        ("redis://:s3cret@db:6379/0", "redis://***@db:6379/0"),
        ("redis://alice:s3cret@db:6379/0", "redis://***@db:6379/0"),
        (
            "rediss://alice:s3cret@db:6380/1?ssl_cert_reqs=none",
            "rediss://***@db:6380/1?ssl_cert_reqs=none",
        ),
        ("redis://db:6379/0?password=s3cret", "redis://db:6379/0?password=***"),
        ("rediss://db:6380/0?db=2&password=s3cret&x=1", "rediss://db:6380/0?db=2&password=***&x=1"),
        ("redis://db/0?PASSWORD=s3cret", "redis://db/0?PASSWORD=***"),
        ("rediss://db/0?ssl_password=s3cret", "rediss://db/0?ssl_password=***"),
        ("unix:///run/redis.sock?db=0&password=s3cret", "unix:///run/redis.sock?db=0&password=***"),
        ("unix://:s3cret@/run/redis.sock?db=0", "unix://***@/run/redis.sock?db=0"),
        ("unix://alice:s3cret@/run/redis.sock", "unix://***@/run/redis.sock"),
    ],
)
def test_passwords_are_masked(url, expected):
    assert redacted(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        "redis://:pa@ss?w/rd@db:6379/0",  # unencoded @, ? and / inside the password
        "redis://db:6379/0?password=s3cret@x&db=1",
        "unix:///run/redis.sock?password=s3cret&password=s3cret",
    ],
)
def test_odd_passwords_never_leak(url):
    assert "s3cret" not in redacted(url)
    assert "pa@ss" not in redacted(url) and "ss?w" not in redacted(url)


def test_the_unavailable_error_names_no_password():
    url = "redis://:s3cret@db:6379/0?password=s3cret"
    with pytest.raises(StoreUnavailableError) as caught, unavailable_on_failure(url):
        raise rexc.ConnectionError("Error 111 connecting to db:6379. Connection refused.")
    assert "s3cret" not in str(caught.value)
