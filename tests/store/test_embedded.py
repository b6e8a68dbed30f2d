from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from chatsvc.store import Store, StoreUnavailableError
from chatsvc.store.embedded import EmbeddedRedis, EmbeddedRedisError
from chatsvc.store.socket_path import MAX_SOCKET_PATH_BYTES, SocketPathError, socket_path
from tests.store.helpers import append, new_tenant, turn

pytestmark = pytest.mark.anyio


async def test_store_unavailable_when_server_down_then_recovers(tmp_path):
    server = EmbeddedRedis(tmp_path, appendfsync="always").start()
    try:
        store = await Store.connect(server.url, prefix="p", socket_timeout_s=0.5)
        tenant = await new_tenant(store)
        session = await store.sessions.create(tenant.id, None, "sys", [1], {})

        server.stop()
        with pytest.raises(StoreUnavailableError, match="unavailable"):
            await store.sessions.get(tenant.id, session.id)
        with pytest.raises(StoreUnavailableError):
            await append(store, tenant.id, session.id, *turn(1))
        with pytest.raises(StoreUnavailableError):
            async with store.sessions.turn_lock(tenant.id, session.id):
                pass

        server.start()  # same port, same data dir
        assert (await store.sessions.get(tenant.id, session.id)).num_messages == 1
        await append(store, tenant.id, session.id, *turn(1))
        assert len(await store.tree.messages(tenant.id, session.id)) == 3
        await store.close()
    finally:
        server.stop()


async def test_frozen_server_times_out_instead_of_hanging(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        store = await Store.connect(server.url, prefix="p", socket_timeout_s=0.3)
        tenant = await new_tenant(store)
        # SIGSTOP: the kernel still accepts connections but nothing answers.
        os.kill(server.pid, signal.SIGSTOP)
        try:
            with pytest.raises(StoreUnavailableError, match="Timeout"):
                await store.tenants.by_name(tenant.name)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert await store.tenants.by_name(tenant.name) == tenant
        await store.close()


@pytest.mark.parametrize("restart", ["clean", "killed"])
async def test_acknowledged_turns_survive_a_server_restart(tmp_path, restart):
    server = EmbeddedRedis(tmp_path, appendfsync="always").start()
    try:
        store = await Store.connect(server.url, prefix="p", session_ttl_s=3600)
        tenant = await new_tenant(store)
        sessions = [await store.sessions.create(tenant.id, None, "sys", [1], {}) for _ in range(3)]
        for n in range(10):
            for session in sessions:
                await append(store, tenant.id, session.id, *turn(n))
        before = {s.id: await store.tree.messages(tenant.id, s.id) for s in sessions}
        await store.close()

        if restart == "clean":
            server.stop()
        else:
            server.kill()  # SIGKILL: only what the AOF holds can come back
        server.start()

        store = await Store.connect(server.url, prefix="p", session_ttl_s=3600)
        assert await store.tenants.by_name(tenant.name) == tenant
        for session in sessions:
            assert await store.tree.messages(tenant.id, session.id) == before[session.id]
            assert (await store.sessions.get(tenant.id, session.id)).num_messages == 21
        listed, _ = await store.sessions.list_page(tenant.id)
        assert {s.id for s in listed} == {s.id for s in sessions}
        await store.close()
    finally:
        server.stop()
    assert (tmp_path / "appendonlydir").is_dir()


def test_two_servers_on_one_data_dir_fail_clearly(tmp_path):
    with EmbeddedRedis(tmp_path) as first:
        second = EmbeddedRedis(tmp_path)
        with pytest.raises(EmbeddedRedisError, match=f"pid {os.getpid()}"):
            second.start()
        assert first.is_running() and not second.is_running()
    # Once the first is stopped the dir is free again.
    with EmbeddedRedis(tmp_path) as again:
        assert again.is_running()


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="appendfsync"):
        EmbeddedRedis(tmp_path, appendfsync="sometimes")
    with pytest.raises(EmbeddedRedisError, match="not been started"):
        _ = EmbeddedRedis(tmp_path).url


async def test_unix_socket_server(tmp_path):
    with EmbeddedRedis(tmp_path / "data", unix_socket=tmp_path / "r.sock") as server:
        assert server.url.startswith("unix://")
        store = await Store.connect(server.url, prefix="p")
        tenant = await new_tenant(store)
        assert await store.tenants.by_name(tenant.name) == tenant
        await store.close()


def _process_state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` ("Z" = exited, not yet reaped), None if gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    return next(line.split()[1] for line in status.splitlines() if line.startswith("State:"))


def _service_script(data_dir, *, parent_death_signal: bool) -> str:
    """A service that starts its server from a worker thread (as the API does through
    anyio.to_thread), writes a key, prints the server's pid and waits to be killed."""
    return f"""
import threading, time, redis
import chatsvc.store.embedded as embedded
from chatsvc.store.embedded import EmbeddedRedis
if not {parent_death_signal!r}:
    embedded.die_with_parent = lambda: None  # as where there is no PR_SET_PDEATHSIG
server = EmbeddedRedis({str(data_dir)!r})
starter = threading.Thread(target=server.start)
starter.start(); starter.join()
redis.Redis.from_url(server.url).set("k", "acknowledged")
print(server.pid, flush=True)
time.sleep(120)
"""


def test_the_server_of_a_killed_service_exits_with_it(tmp_path):
    # Started from a thread that then ended, the server used to outlive a SIGKILLed
    # service until the next start on its data dir.
    script = _service_script(tmp_path, parent_death_signal=True)
    repo = Path(__file__).resolve().parents[2]
    service = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=repo)
    server_pid = int(service.stdout.readline())
    try:
        service.kill()
        service.wait()
        deadline = time.monotonic() + 30  # a generous bound, not a speed target
        while _process_state(server_pid) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _process_state(server_pid) in (None, "Z")
        # It saved on its way out: the next start finds the acknowledged write.
        with EmbeddedRedis(tmp_path) as server:
            assert redis.Redis.from_url(server.url).get("k") == b"acknowledged"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server_pid, signal.SIGKILL)
        service.stdout.close()


def test_orphan_of_a_killed_service_is_stopped_by_the_next_start(tmp_path):
    # Where the server cannot be told to die with its service, a SIGKILLed service
    # leaves it running; the next start on the data dir stops it cleanly.
    script = _service_script(tmp_path, parent_death_signal=False)
    repo = Path(__file__).resolve().parents[2]
    service = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=repo)
    server_pid = int(service.stdout.readline())
    try:
        service.kill()
        service.wait()
        os.kill(server_pid, 0)  # the orphan outlived its service
        with EmbeddedRedis(tmp_path) as server:
            assert server.pid != server_pid
            assert redis.Redis.from_url(server.url).get("k") == b"acknowledged"
            assert _process_state(server_pid) in (None, "Z")  # the orphan was stopped
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server_pid, signal.SIGKILL)
        service.stdout.close()


def _listening_tcp_inodes() -> set[str]:
    """Socket inodes of every TCP socket on this host in the LISTEN state."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    inodes.add(fields[9])
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return inodes


def _modes(root: Path) -> dict[str, int]:
    found = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        found[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return found


async def test_the_server_has_no_tcp_listener_and_keeps_its_files_private(tmp_path):
    data = tmp_path / "state" / "redis"  # neither level exists yet
    with EmbeddedRedis(data, appendfsync="always") as server:
        assert server.url == f"unix://{data / 'valkey.sock'}"
        # No TCP port at all: no other local user (or web page) can reach it over TCP.
        assert not _socket_inodes(server.pid) & _listening_tcp_inodes()
        client = redis.Redis.from_url(server.url)
        assert client.config_get("port") == {"port": "0"}
        store = await Store.connect(server.url, prefix="p")
        tenant = await new_tenant(store)
        session = await store.sessions.create(tenant.id, None, "private words", [1], {})
        await append(store, tenant.id, session.id, *turn(1))
        await store.close()
        client.close()
        modes = _modes(data)
        assert modes["valkey.sock"] & 0o077 == 0
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
    modes = _modes(data)  # the AOF, the RDB written at shutdown, the log, the lock file
    assert {"appendonlydir", "valkey.log", "chatsvc.lock"} <= set(modes)
    for name, mode in modes.items():
        if (data / name).is_dir():
            assert mode == 0o700, name
        else:
            assert mode & 0o077 == 0, f"{name} is {mode:04o}"


def test_an_existing_data_dir_left_readable_is_tightened(tmp_path):
    data = tmp_path / "redis"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    with EmbeddedRedis(data):
        assert stat.S_IMODE(data.stat().st_mode) == 0o700


async def test_a_data_dir_too_long_for_a_socket_path_gets_a_private_socket_dir(tmp_path):
    data = tmp_path / ("d" * 60) / ("e" * 60)
    with EmbeddedRedis(data) as server:
        sock = Path(server.url.removeprefix("unix://"))
        assert sock.parent != data and len(os.fsencode(sock)) <= MAX_SOCKET_PATH_BYTES
        info = sock.parent.lstat()
        assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700
        store = await Store.connect(server.url, prefix="p")
        tenant = await new_tenant(store)
        await store.close()
        server.stop()
        server.start()  # same data dir, same socket: clients reconnect
        assert server.url == f"unix://{sock}"
        store = await Store.connect(server.url, prefix="p")
        assert await store.tenants.by_name(tenant.name) == tenant
        await store.close()
    # Stopped cleanly: the private dir goes with its socket, nothing is left in /tmp.
    assert not sock.parent.exists()


def test_a_socket_dir_someone_else_made_is_refused(tmp_path, monkeypatch):
    data = tmp_path / ("d" * 60) / ("e" * 60)
    planted = socket_path(data).parent  # made by "us" here; then seen as another user's
    uid = planted.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
    try:
        with pytest.raises(SocketPathError, match="owned by uid"):
            socket_path(data)
    finally:
        planted.rmdir()
        # The name for that other uid, made (and then refused) on the way.
        planted.with_name(planted.name.replace(f"-{uid}-", f"-{uid + 1}-", 1)).rmdir()


def test_an_explicit_socket_path_over_the_limit_is_refused(tmp_path):
    too_long = tmp_path / ("s" * MAX_SOCKET_PATH_BYTES)
    with pytest.raises(SocketPathError, match="over the limit"):
        EmbeddedRedis(tmp_path / "data", unix_socket=too_long).start()


async def test_a_frozen_server_costs_each_command_three_tries_at_most(tmp_path, monkeypatch):
    # A command is tried three times (two retries), each waiting one socket
    # timeout for its reply, and then fails. redis-py once did far more: a unix
    # connect ran its handshake inside a retried step (three waits per connect),
    # and a due health check nested further retries in every reconnect, so one
    # command against a frozen server never ended.
    from redis.asyncio.connection import AbstractConnection

    replies_waited = []
    read_response = AbstractConnection.read_response
    frozen_socket = []

    async def counted(self, *args, **kwargs):
        # This server's replies only: services of session fixtures run in other threads
        # of this process, and their stores' presence refreshes pass here too.
        if getattr(self, "path", None) in frozen_socket:
            replies_waited.append(1)
        return await read_response(self, *args, **kwargs)

    with EmbeddedRedis(tmp_path) as server:
        frozen_socket.append(str(server.unix_socket))
        store = await Store.connect(server.url, prefix="p", socket_timeout_s=0.3)
        # Its refreshes would be counted too, and one beside a command would open the pool's
        # second connection (a second due health check): stopped before its first.
        await store.context.presence.stop()
        tenant = await new_tenant(store)
        assert len(store.redis.connection_pool._available_connections) == 1
        assert store.redis.connection_pool._available_connections[0].path in frozen_socket
        for conn in store.redis.connection_pool._available_connections:
            conn.next_health_check = 0  # as if idle for longer than any check interval
        monkeypatch.setattr(AbstractConnection, "read_response", counted)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            for _ in range(4):
                replies_waited.clear()
                with pytest.raises(StoreUnavailableError):
                    # The deadline only keeps a regression from hanging the suite.
                    await asyncio.wait_for(store.tenants.by_name(tenant.name), 120)
                assert 1 <= len(replies_waited) <= 3
        finally:
            os.kill(server.pid, signal.SIGCONT)
        await store.close()
