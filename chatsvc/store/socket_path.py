"""Where the embedded server's unix socket goes, within the kernel's path limit.

The socket lives in a directory only its owner can enter, so no other local
user can connect (the socket's own 0700 mode says the same on Linux; some
BSDs ignore socket modes, the directory's hold everywhere).

A unix socket's path must fit in ``sun_path`` (107 bytes on Linux, 103 on the
BSDs and macOS). The default place, inside the data dir, can be longer than
that; the socket then goes to a directory of its own under the system's temp
dir, named by the user id and a hash of the data dir, so the same data dir
always gets the same socket (clients reconnect after a restart). That
directory is made 0700 by us; one found there that is not ours and private
is refused rather than used, since anyone could have made it first.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import sys
import tempfile
from pathlib import Path

from chatsvc.paths import PRIVATE_DIR_MODE, private_dir
from chatsvc.store.errors import StoreError

MAX_SOCKET_PATH_BYTES = 107 if sys.platform.startswith("linux") else 103
SOCKET_NAME = "valkey.sock"


class SocketPathError(StoreError):
    """No private place for the socket within the path limit."""


def fits(path: Path) -> bool:
    """True if ``path`` is short enough to bind a unix socket to."""
    return len(os.fsencode(path)) <= MAX_SOCKET_PATH_BYTES


def socket_path(data_dir: Path, explicit: Path | None = None) -> Path:
    """The socket path for a server on ``data_dir``; its directory exists and is private.

    ``explicit``: the caller's choice, used as given (its directory is created
    0700 if missing) or refused when too long. Else ``data_dir/valkey.sock``,
    or the temp-dir fallback when that is too long.
    """
    if explicit is not None:
        if not fits(explicit):
            raise SocketPathError(_too_long(explicit))
        if not explicit.parent.exists():
            private_dir(explicit.parent)
        return explicit
    inside = data_dir / SOCKET_NAME
    if fits(inside):
        return inside
    fallback = _fallback(data_dir)
    if not fits(fallback):
        raise SocketPathError(
            f"{_too_long(inside)}, and so is the fallback {fallback}; "
            "use a shorter data dir or TMPDIR"
        )
    _private_socket_dir(fallback.parent)
    return fallback


def remove_fallback_dir(data_dir: Path, sock: Path) -> None:
    """Remove the temp-dir fallback's directory of a stopped server, if ``sock`` is in it
    and it is empty (a clean shutdown removed the socket; a killed server's stays, and
    so does the directory). Left behind, every long data dir ever served would leave
    one in the temp dir."""
    if sock.parent != _fallback(data_dir).parent:
        return
    with contextlib.suppress(OSError):
        sock.parent.rmdir()


def _fallback(data_dir: Path) -> Path:
    digest = hashlib.sha256(os.fsencode(data_dir)).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"chatsvc-{os.geteuid()}-{digest}" / SOCKET_NAME


def _too_long(path: Path) -> str:
    return (
        f"unix socket path {path} is {len(os.fsencode(path))} bytes, "
        f"over the limit of {MAX_SOCKET_PATH_BYTES}"
    )


def _private_socket_dir(path: Path) -> None:
    try:
        path.mkdir(mode=PRIVATE_DIR_MODE)
    except FileExistsError:
        pass
    info = path.lstat()  # lstat: a symlink planted under that name is refused, not followed
    if not stat.S_ISDIR(info.st_mode):
        raise SocketPathError(f"socket dir {path} exists and is not a directory")
    if info.st_uid != os.geteuid():
        raise SocketPathError(
            f"socket dir {path} is owned by uid {info.st_uid}, not by this user; "
            "remove it or use a shorter data dir"
        )
    if stat.S_IMODE(info.st_mode) != PRIVATE_DIR_MODE:
        path.chmod(PRIVATE_DIR_MODE)
