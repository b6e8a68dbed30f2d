"""What the suites that run the live service share: a small engine config for the
real model and the per-tenant HTTP client fixtures.

    engine_config(num_gpu_blocks=..., num_host_blocks=...)   # the real model, small pool
    acme = tenant_client("api", ACME_KEY)                     # in a conftest: a fixture
"""

from __future__ import annotations

import pytest

from chatsvc.engine.config import EngineConfig
from tests import http_helpers

BLOCK_SIZE = 16
# Small enough that a test can overflow it with a message under the char limit.
MAX_MODEL_LEN = 1024


def engine_config(num_gpu_blocks: int, num_host_blocks: int) -> EngineConfig:
    """The default model (SmolLM2-135M) with a KV pool and a batch sized for tests."""
    return EngineConfig(
        model="smollm2",
        block_size=BLOCK_SIZE,
        num_gpu_blocks=num_gpu_blocks,
        num_host_blocks=num_host_blocks,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=256,
        max_num_seqs=16,
        # A few shapes, not all: every test server warms up (service.start_engine).
        warm_up_s=1.0,
    )


def tenant_client(server_fixture: str, key: str | None, timeout_s: float = 120):
    """A fixture: an HTTP client of the live server that fixture ``server_fixture``
    yields, sending ``key`` (a tenant's or the admin's; None: no key)."""

    @pytest.fixture
    def fixture(request):
        server = request.getfixturevalue(server_fixture)
        with http_helpers.client(server.url, key, timeout_s) as http:
            yield http

    return fixture
