"""The per-tenant request rate: a tenant past it waits, then gets 429; others do not notice.

A server of its own with a rate of one request a second in bursts of three
(the shared servers of the suites run without the limit: they send hundreds of
requests a second from one tenant).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from chatsvc.api.shared.request_rate import BYTES_PER_REQUEST, REFUSAL_HOLD_S, TokenBuckets
from chatsvc.config import Limits
from tests.reliability.conftest import ACME_KEY, ADMIN_KEY, GLOBEX_KEY, client, start_server

RATE, BURST = 1, 3


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_serves_its_burst_then_reserves_ahead_then_refuses():
    clock = Clock()
    buckets = TokenBuckets(rate=2, burst=3, clock=clock)
    assert [buckets.reserve("a", 1.0) for _ in range(3)] == [(True, 0.0)] * 3
    # Past the burst a token is reserved ahead, 1/rate apart, as far as the wait allows.
    assert buckets.reserve("a", 1.0) == (True, pytest.approx(0.5))
    assert buckets.reserve("a", 1.0) == (True, pytest.approx(1.0))
    granted, retry_in = buckets.reserve("a", 1.0)
    assert not granted and retry_in == pytest.approx(0.5)  # its token: 1.5 s away
    assert buckets.reserve("b", 1.0) == (True, 0.0)  # another key has its own bucket
    clock.now += 0.5  # the refusal took nothing: one token later the wait is 1 s again
    assert buckets.reserve("a", 1.0) == (True, pytest.approx(1.0))
    clock.now += 60  # a long pause refills up to the burst, never past it
    assert [buckets.reserve("a", 0.0)[0] for _ in range(4)] == [True, True, True, False]
    assert buckets.refused == 2


def test_a_charge_after_the_request_makes_the_next_ones_wait_for_it():
    clock = Clock()
    buckets = TokenBuckets(rate=2, burst=3, clock=clock)
    assert buckets.reserve("a", 1.0) == (True, 0.0)
    buckets.charge("a", 4)  # it read 4 more tokens' worth: 3 - 1 - 4 = -2 left
    granted, retry_in = buckets.reserve("a", 1.0)
    assert not granted and retry_in == pytest.approx(0.5)  # its token is 1.5 s away
    assert buckets.reserve("b", 1.0) == (True, 0.0)  # nobody else pays for it
    clock.now += 1.0
    assert buckets.reserve("a", 1.0) == (True, pytest.approx(0.5))
    buckets.charge("a", 0)  # a request within its own token costs nothing more
    clock.now += 60
    assert [buckets.reserve("a", 0.0)[0] for _ in range(4)] == [True, True, True, False]


def test_refilled_buckets_are_dropped_so_the_map_stays_small():
    clock = Clock()
    buckets = TokenBuckets(rate=10, burst=5, clock=clock)
    for i in range(1000):
        buckets.reserve(f"k{i}", 1.0)
        clock.now += 0.01  # each key is full again 0.1 s after its request
    assert len(buckets._buckets) < 300  # noqa: SLF001 - the invariant under test


def test_a_rate_of_zero_is_off_and_negative_is_refused():
    Limits(tenant_requests_per_s=0).validate()
    with pytest.raises(ValueError, match="tenant_requests_per_s"):
        Limits(tenant_requests_per_s=-1).validate()
    with pytest.raises(ValueError, match="tenant_request_burst"):
        Limits(tenant_request_burst=0).validate()


@pytest.fixture(scope="module")
def rate_server(redis_server):
    limits = Limits(max_tokens_cap=8, tenant_requests_per_s=RATE, tenant_request_burst=BURST)
    with start_server(redis_server.url, limits) as live:
        yield live


def _send(server, i: int) -> tuple[str, int, object, float]:
    """acme's i-th request of the flood: session creations and listings, alternately
    (one bucket per tenant, whatever the route)."""
    with client(server, ACME_KEY) as http:
        began = time.monotonic()
        if i % 2:
            response = http.get("/sessions")
        else:
            response = http.post("/sessions", json={"metadata": {"from": "flood"}})
        return response.request.method, response.status_code, response, time.monotonic() - began


@pytest.mark.slow
def test_a_flood_waits_then_gets_429_and_other_tenants_are_served(rate_server):
    # Eight at once: the burst runs now, one more waits its turn (1/RATE s, within the
    # queue), the rest are refused (one more may be served where the eight took long
    # enough to arrive for a token to come in).
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: _send(rate_server, i), range(8)))
    served = [method for method, status, _, _ in results if status in (200, 201)]
    refused = [status for _, status, _, _ in results if status not in (200, 201)]
    assert BURST + 1 <= len(served) <= BURST + 2, results
    assert refused == [429] * (8 - len(served)), results
    for _, status, response, seconds in results:
        if status == 429:
            error = response.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert f"{RATE} a second" in error["message"]
            assert f"bursts of {BURST}" in error["message"]
            assert int(response.headers["Retry-After"]) >= 1
            assert seconds >= REFUSAL_HOLD_S  # a refusal is not answered at once
    # The one past the burst waited for its token, then ran.
    assert max(seconds for _, status, _, seconds in results if status != 429) >= 0.5 / RATE

    # While acme is over its rate, another tenant, the admin and the probes are not.
    with (
        client(rate_server, GLOBEX_KEY) as globex,
        client(rate_server, ADMIN_KEY) as admin,
        client(rate_server, ACME_KEY) as acme,
    ):
        assert [globex.get("/sessions").status_code for _ in range(BURST)] == [200] * BURST
        assert admin.get("/admin/cache").status_code == 200
        metrics = admin.get("/metrics").text
        refused_count = 8 - len(served)
        counted = {
            line.split("outcome=")[1].split('"')[1]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("chatsvc_rate_limited_requests_total{")
        }
        # Past the burst each served request waited, but for one whose token came in.
        assert counted["refused"] == refused_count, counted
        assert 1 <= counted["delayed"] <= len(served) - BURST, counted
        assert acme.get("/healthz").status_code == 200
        assert acme.get("/readyz").status_code == 200
        # A wrong key is not a tenant's request: it gets its 401 however many it sends.
        with client(rate_server, "not-a-key-of-anyone-0000") as stranger:
            assert {stranger.get("/sessions").status_code for _ in range(BURST + 2)} == {401}

        time.sleep(BURST / RATE)  # the bucket refills; the refused ones made nothing
        listed = acme.get("/sessions", params={"limit": 100})
        assert listed.status_code == 200, listed.text
        floods = [s for s in listed.json()["sessions"] if s["metadata"] == {"from": "flood"}]
        assert len(floods) == served.count("POST")


# --- reads charged by their bytes: a write to a large session reads all of it -------

CHARGE_RATE, CHARGE_BURST = 10, 10


@pytest.fixture(scope="module")
def charge_server(redis_server):
    limits = Limits(
        max_tokens_cap=8, tenant_requests_per_s=CHARGE_RATE, tenant_request_burst=CHARGE_BURST
    )
    with start_server(redis_server.url, limits) as live:
        yield live


def _delayed(server) -> float:
    with client(server, ADMIN_KEY) as admin:
        for line in admin.get("/metrics").text.splitlines():
            if line.startswith('chatsvc_rate_limited_requests_total{outcome="delayed"'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _add_items(http, conversation: str, items: list[dict]) -> None:
    added = http.post(f"/v1/conversations/{conversation}/items", json={"items": items})
    assert added.status_code == 200, added.text[:500]


def test_a_tenant_writing_to_a_large_session_pays_for_its_reads_others_do_not(charge_server):
    big_item = {"type": "message", "role": "user", "content": "word " * 6_400}  # 32,000 chars
    small_item = {"type": "message", "role": "user", "content": "hello"}
    with client(charge_server, ACME_KEY) as acme, client(charge_server, GLOBEX_KEY) as globex:
        big = acme.post("/v1/conversations", json={}).json()["id"]
        for _ in range(5):  # ~3.2 MiB of items; each add reads what is there before it
            _add_items(acme, big, [big_item] * 20)
        small = globex.post("/v1/conversations", json={}).json()["id"]
        time.sleep(2 * CHARGE_BURST / CHARGE_RATE)  # both buckets full again

        # globex: 8 adds to a small session are 8 tokens, inside its burst: no wait.
        before = _delayed(charge_server)
        for _ in range(8):
            _add_items(globex, small, [small_item])
        assert _delayed(charge_server) == before

        # acme: each add to its 3.0-3.1 MiB session reads it whole: its first MiB is in
        # its own token, the 2 whole MiB past it cost 2 more. The 8th may start only
        # once 7 x 3 + 1 tokens came in, 10 of them the burst, the rest at the rate,
        # however fast the machine.
        charged = (3 * 2**20 - BYTES_PER_REQUEST) // BYTES_PER_REQUEST
        began = time.monotonic()
        for _ in range(8):
            _add_items(acme, big, [small_item])
        took = time.monotonic() - began
        assert took >= (7 * (1 + charged) + 1 - CHARGE_BURST) / CHARGE_RATE - 0.05, took
        assert _delayed(charge_server) >= before + 3
