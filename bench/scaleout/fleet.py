"""A loopback fleet: N ``chatsvc serve`` replicas on one Redis, behind the shipped nginx config.

    with Fleet(work_dir, redis_url, replicas=2) as fleet:
        fleet.url                 # nginx
        fleet.replicas[0].url     # one replica, bypassing nginx
        fleet.kill(0)             # SIGKILL, as a crash

Replicas are child processes (``bench.live_server.ProcessServer``) with
``CHATSVC_REPLICA_ID`` = ``r1``, ``r2``, ... and the same key prefix, tenants
and admin key, so any replica serves any session.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.live_server import ProcessServer
from bench.scaleout.nginx import Nginx

ADMIN_KEY = "scaleout-admin-key-0001"


def replica_env(
    redis_url: str, prefix: str, api_keys: dict[str, str], replica_id: str, **extra: str
) -> dict[str, str]:
    """The CHATSVC_* variables of one replica (small KV pool: the tests' machine has 2 cores)."""
    env = {
        "CHATSVC_REDIS_URL": redis_url,
        "CHATSVC_KEY_PREFIX": prefix,
        "CHATSVC_API_KEYS": ",".join(f"{name}:{key}" for name, key in api_keys.items()),
        "CHATSVC_ADMIN_KEY": ADMIN_KEY,
        "CHATSVC_REPLICA_ID": replica_id,
        "CHATSVC_NUM_GPU_BLOCKS": "512",
        "CHATSVC_NUM_HOST_BLOCKS": "0",
        "CHATSVC_MAX_MODEL_LEN": "2048",
        "CHATSVC_MAX_TOKENS_CAP": "64",
    }
    env.update(extra)
    return env


class Fleet:
    """``replicas`` chatsvc processes and one nginx; ``nginx=False`` starts the replicas only."""

    def __init__(
        self,
        work_dir: Path,
        redis_url: str,
        *,
        prefix: str,
        api_keys: dict[str, str],
        replicas: int = 2,
        nginx: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.replicas = [
            ProcessServer(
                replica_env(redis_url, prefix, api_keys, f"r{i + 1}", **(env or {})),
                self.work_dir / f"r{i + 1}.log",
            )
            for i in range(replicas)
        ]
        self.ids = [f"r{i + 1}" for i in range(replicas)]
        self.nginx = (
            Nginx(self.work_dir / "nginx", [f"127.0.0.1:{r.port}" for r in self.replicas])
            if nginx
            else None
        )

    @property
    def url(self) -> str:
        assert self.nginx is not None, "this fleet runs without nginx"
        return self.nginx.url

    def start(self, timeout_s: float = 600) -> Fleet:
        try:
            # Model loads overlap: both replicas come up in about the time of one.
            with ThreadPoolExecutor(len(self.replicas)) as pool:
                list(pool.map(lambda r: r.start(timeout_s), self.replicas))
            if self.nginx is not None:
                self.nginx.start()
        except BaseException:
            self.stop()
            raise
        return self

    def replica_of(self, upstream: str) -> int:
        """Index of the replica at nginx's ``host:port``."""
        return next(i for i, r in enumerate(self.replicas) if upstream.endswith(f":{r.port}"))

    def kill(self, index: int) -> None:
        self.replicas[index].kill()

    def admin(self, index: int, path: str = "/admin/cache") -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        return httpx.get(self.replicas[index].url + path, headers=headers, timeout=60)

    def stop(self) -> None:
        if self.nginx is not None:
            self.nginx.stop()
        for replica in self.replicas:
            replica.stop()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
