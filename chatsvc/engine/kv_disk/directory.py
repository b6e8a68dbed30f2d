"""The disk tier's directory: opening it safely, finding its blocks, its budget.

    <kv root>/                      0700 ($CHATSVC_KV_DISK_DIR or $CHATSVC_DATA_DIR/kv)
        weight-digests.json         0600, remembered checkpoint digests
        <fingerprint hex>/          0700, one per model fingerprint
            lock                    0600, flock'ed by the one process using it
            forgotten               0600, names of deleted blocks whose unlink failed
            00/ .. ff/              0700, by the hash's first byte
                <hash>-<parent>-<owner>-<s|p>.kv   0600

Files and directories are created with those modes (never widened by the
umask), and directories the tier finds are narrowed to 0700, so no other local
user can read a block: KV can be inverted to text.

Opening fails (``TierUnavailable``) when the directory cannot be created or
written (a read-only filesystem, no permission) or another process holds the
lock; the engine then serves without the tier.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from pathlib import Path
from typing import NamedTuple

from chatsvc.engine.kv_disk.fileformat import TMP_PREFIX, BlockMeta, file_name, parse_name

DIR_MODE = 0o700
FILE_MODE = 0o600
# The default budget: the smaller of these, re-checked while the service runs.
AUTO_MAX_BYTES = 8 << 30
AUTO_FREE_FRACTION = 0.10


class TierUnavailable(Exception):
    """The disk tier cannot be used here (the message says why)."""


class FoundBlock(NamedTuple):
    meta: BlockMeta
    mtime: float


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and parents) as 0700, or narrow an existing one to 0700."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o777 != DIR_MODE:
        path.chmod(DIR_MODE)


class TierDirectory:
    """One fingerprint's directory, locked for this process."""

    def __init__(self, root: Path, fingerprint: bytes) -> None:
        self.root = Path(root)
        self.path = self.root / fingerprint.hex()
        self._lock_fd: int | None = None

    def open(self) -> TierDirectory:
        """Create, lock and probe the directory; raises TierUnavailable."""
        try:
            make_private_dir(self.root)
            make_private_dir(self.path)
            fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        except OSError as exc:
            raise TierUnavailable(f"{self.path} is not writable ({_reason(exc)})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise TierUnavailable(f"{self.path} is in use by another process") from None
            raise TierUnavailable(f"{self.path} cannot be locked ({_reason(exc)})") from None
        self._lock_fd = fd
        try:
            self._probe()
        except OSError as exc:
            self.close()
            raise TierUnavailable(f"{self.path} is not writable ({_reason(exc)})") from None
        return self

    def _probe(self) -> None:
        # A directory can be openable yet refuse new files (read-only bind mounts,
        # a full or read-only filesystem): find out now, not on the first write.
        probe = self.path / f"{TMP_PREFIX}probe-{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
            os.unlink(probe)

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # -- blocks -------------------------------------------------------------------

    def subdir(self, hash_: bytes) -> Path:
        return self.path / hash_[:1].hex()

    def block_path(self, meta: BlockMeta) -> Path:
        return self.subdir(meta.hash) / file_name(meta)

    def scratch_path(self, name: str) -> Path:
        """A file for this process's own use (the warm-up's probe block): no block has
        its name, and the start-up scan removes it if a crash leaves it."""
        return self.path / f"{TMP_PREFIX}{name}-{os.getpid()}"

    @property
    def forgotten(self) -> Path:
        """The list of block files deleted (forgotten) whose unlink failed (``DeleteJob``)."""
        return self.path / "forgotten"

    def scan(self) -> list[FoundBlock]:
        """Every block file (from names and mtimes only); leftovers of crashed writes and
        scratch files go.

        O(files): one directory listing per subdirectory and one stat per file. A
        file the ``forgotten`` list names is never found: its unlink is retried, and
        the list keeps only the names still there.
        """
        forgotten = self._read_forgotten()
        still_there = []
        found = []
        for sub in os.scandir(self.path):
            if not sub.is_dir(follow_symlinks=False):
                if sub.name.startswith(TMP_PREFIX):
                    _unlink(sub.path)  # a crashed process's scratch or temporary file
                continue
            if sub.stat(follow_symlinks=False).st_mode & 0o777 != DIR_MODE:
                os.chmod(sub.path, DIR_MODE)
            for entry in os.scandir(sub.path):
                meta = parse_name(entry.name)
                if meta is None or meta.hash[:1].hex() != sub.name:
                    if entry.name.startswith(TMP_PREFIX) or meta is not None:
                        _unlink(entry.path)  # a crashed write, or a file in the wrong place
                    continue
                if entry.name in forgotten:
                    try:
                        _unlink(entry.path)
                    except OSError:
                        still_there.append(entry.name)
                    continue
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.st_mode & 0o777 != FILE_MODE:
                    os.chmod(entry.path, FILE_MODE)
                found.append(FoundBlock(meta, stat.st_mtime))
        if forgotten:
            self._write_forgotten(still_there)
        return found

    def _read_forgotten(self) -> set[str]:
        try:
            return set(self.forgotten.read_text().split())
        except FileNotFoundError:
            return set()

    def _write_forgotten(self, names: list[str]) -> None:
        if not names:
            _unlink(str(self.forgotten))
            return
        tmp = self.path / f"{TMP_PREFIX}forgotten"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        try:
            os.write(fd, "".join(f"{name}\n" for name in names).encode())
        finally:
            os.close(fd)
        os.replace(tmp, self.forgotten)

    # -- space --------------------------------------------------------------------

    def auto_budget(self, used_bytes: int) -> int:
        """The default budget: min(AUTO_MAX_BYTES, a fraction of free space + what we use)."""
        free = shutil.disk_usage(self.path).free
        return int(min(AUTO_MAX_BYTES, AUTO_FREE_FRACTION * (free + used_bytes)))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__
