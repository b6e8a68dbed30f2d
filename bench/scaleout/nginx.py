"""Run the shipped deploy/nginx/nginx.conf on loopback, in front of given replicas.

The config file is used as is: a working directory gets a symlink to it and
the two per-deployment includes it expects beside it (``chatsvc-upstreams.conf``,
``chatsvc-listen.conf``), so nginx resolves them from there. nginx runs in the
foreground as a child process (``daemon off``) with its prefix in the working
directory; its access log (stdout) is kept in ``access.log`` and read by
``entries()`` to see which replica answered each request.

nginx comes from Debian's package: ``ensure_nginx()`` installs it with apt-get
when it is missing and this process may (root).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench.live_server import free_port

REPO = Path(__file__).resolve().parents[2]
SHIPPED_CONF = REPO / "deploy" / "nginx" / "nginx.conf"
# The passive health check of every replica line (see deploy/nginx/chatsvc-upstreams.conf).
HEALTH = "max_fails=1 fail_timeout=5s"


class NginxUnavailable(RuntimeError):
    """nginx is not installed and could not be installed here; the message says why."""


def _installed() -> str | None:
    # /usr/sbin is not on every PATH (a non-root shell on Debian).
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None
    )


def ensure_nginx() -> str:
    """Path of the nginx binary, installing Debian's package first if needed."""
    found = _installed()
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise NginxUnavailable("nginx is not installed and apt-get cannot run here (not root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "nginx"]
    result = subprocess.run(install, env=env, capture_output=True, text=True)
    if result.returncode != 0:  # a stale package list: refresh it once
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        result = subprocess.run(install, env=env, capture_output=True, text=True)
    found = _installed()
    if result.returncode != 0 or not found:
        raise NginxUnavailable(f"apt-get install nginx failed:\n{result.stderr[-2000:]}")
    return found


def upstream_lines(addresses: list[str], health: str = HEALTH) -> str:
    """``chatsvc-upstreams.conf`` for replicas at ``host:port`` addresses."""
    return "".join(f"server {address} {health};\n" for address in addresses)


@dataclass(frozen=True)
class AccessEntry:
    """One access-log line: the request, its status, the hash key and the replicas tried."""

    method: str
    path: str
    status: int
    key: str
    upstreams: tuple[str, ...]
    upstream_statuses: tuple[str, ...]
    request_time_s: float

    @property
    def upstream(self) -> str:
        """The replica that gave the final answer ("" when none did)."""
        return self.upstreams[-1] if self.upstreams else ""


_LINE = re.compile(
    r'"(?P<method>\S+) (?P<path>\S+) [^"]*" (?P<status>\d+) \d+ key="(?P<key>[^"]*)" '
    r'upstream="(?P<up>[^"]*)" upstream_status="(?P<ups>[^"]*)" request_id=\S+ '
    r"rt=(?P<rt>[\d.]+)"
)


def parse_access_line(line: str) -> AccessEntry | None:
    match = _LINE.search(line)
    if match is None:
        return None

    def split(value: str) -> tuple[str, ...]:
        # nginx separates tries with ", " and replica groups with " : "
        return tuple(p.strip() for p in re.split(r"[,:] ", value) if p.strip() not in ("", "-"))

    return AccessEntry(
        method=match["method"],
        path=match["path"],
        status=int(match["status"]),
        key=match["key"],
        upstreams=split(match["up"]),
        upstream_statuses=split(match["ups"]),
        request_time_s=float(match["rt"]),
    )


class Nginx:
    """The shipped config serving ``upstreams`` on 127.0.0.1:``port``; a context manager."""

    def __init__(
        self, work_dir: Path, upstreams: list[str], *, port: int | None = None, health: str = HEALTH
    ) -> None:
        self.binary = ensure_nginx()
        self.work_dir = Path(work_dir)
        self.conf_dir = self.work_dir / "conf"
        self.prefix = self.work_dir / "prefix"
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.access_log = self.work_dir / "access.log"
        self.error_log = self.work_dir / "error.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        self.prefix.mkdir(parents=True, exist_ok=True)
        link = self.conf_dir / "nginx.conf"
        if not link.exists():
            link.symlink_to(SHIPPED_CONF)
        self.set_upstreams(upstreams, health)
        (self.conf_dir / "chatsvc-listen.conf").write_text(f"listen 127.0.0.1:{self.port};\n")

    def set_upstreams(self, upstreams: list[str], health: str = HEALTH) -> None:
        """Rewrite the replica list; a running nginx picks it up on ``reload()``."""
        (self.conf_dir / "chatsvc-upstreams.conf").write_text(upstream_lines(upstreams, health))

    def command(self, *extra: str) -> list[str]:
        globals_ = "daemon off;"
        if os.geteuid() == 0:
            # Workers would drop to "nobody", who cannot enter a private temp dir.
            globals_ += " user root;"
        return [
            self.binary,
            "-p", f"{self.prefix}/",
            "-c", str(self.conf_dir / "nginx.conf"),
            "-e", "stderr",
            "-g", globals_,
            *extra,
        ]  # fmt: skip

    def check_config(self) -> str:
        """``nginx -t`` on this setup; raises RuntimeError with nginx's words if it is invalid."""
        result = subprocess.run(self.command("-t"), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"nginx -t failed:\n{result.stderr}")
        return result.stderr

    def start(self, timeout_s: float = 30) -> Nginx:
        with self.access_log.open("ab") as out, self.error_log.open("ab") as err:
            self.process = subprocess.Popen(
                self.command(), stdout=out, stderr=err, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited on start:\n{self.error_log.read_text()[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("nginx did not listen in time") from None
                time.sleep(0.05)

    def reload(self) -> None:
        """SIGHUP: re-read the config (new upstreams) without dropping connections."""
        assert self.process is not None
        self.process.send_signal(signal.SIGHUP)

    def entries(self) -> list[AccessEntry]:
        """Every access-log entry so far (nginx writes a line as each request ends)."""
        text = self.access_log.read_text(errors="replace") if self.access_log.exists() else ""
        return [e for e in map(parse_access_line, text.splitlines()) if e is not None]

    def wait_for_entries(self, predicate, timeout_s: float = 30) -> list[AccessEntry]:
        """Entries once ``predicate(entries)`` holds: the line lands just after the reply."""
        deadline = time.monotonic() + timeout_s
        while True:
            entries = self.entries()
            if predicate(entries):
                return entries
            if time.monotonic() > deadline:
                raise TimeoutError(f"access log never satisfied the check: {entries[-5:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGQUIT)  # graceful: finish open requests
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=15)

    def __enter__(self) -> Nginx:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
