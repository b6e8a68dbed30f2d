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

Directories of other fingerprints stay (switching back is warm) until they have been
unused for the time ``prune_others`` is given: every upgrade of the kernels, of the
model or of a dtype leaves one, each up to its own budget, so without an end they
would fill the disk one upgrade at a time. Unused means no process holds its lock,
and its ``lock`` file's mtime (set on open and on close) is that old.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import NamedTuple

from chatsvc.engine.kv_disk.fileformat import TMP_PREFIX, BlockMeta, file_name, parse_name

DIR_MODE = 0o700
FILE_MODE = 0o600
# The default budget: the smaller of these, re-checked while the service runs.
AUTO_MAX_BYTES = 8 << 30
AUTO_FREE_FRACTION = 0.10
# A fingerprint's directory name: 16 bytes in hex.
FINGERPRINT_HEX = 32
# What a directory being removed is renamed to first, so no process opens it half gone.
REMOVING = ".removing-"
log = logging.getLogger(__name__)


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
            os.utime(fd)  # in use now: not idle for prune_others
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
            # Last used now, whenever it was opened; a failure only makes it look older.
            with contextlib.suppress(OSError):
                os.utime(self._lock_fd)
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

    # -- other fingerprints -------------------------------------------------------

    def prune_others(self, max_idle_s: float, now: float | None = None) -> list[str]:
        """Remove the directories of other fingerprints under the root that no process
        holds and whose lock file is ``max_idle_s`` old or older (and what an interrupted
        removal left); the names removed. Each is locked, renamed aside and unlocked
        here, then deleted on a background thread: a large tier takes seconds to unlink,
        and a start should not wait for it."""
        now = time.time() if now is None else now
        removed, doomed = [], []
        try:
            entries = list(os.scandir(self.root))
        except OSError as exc:
            log.warning("KV disk tier: cannot list %s (%s)", self.root, _reason(exc))
            return []
        for entry in entries:
            name = entry.name
            if name.startswith(REMOVING) and entry.is_dir(follow_symlinks=False):
                doomed.append(entry.path)  # a removal a stop interrupted
            elif _is_fingerprint(name) and name != self.path.name:
                aside = entry.is_dir(follow_symlinks=False) and self._set_aside(
                    entry, now, max_idle_s
                )
                if aside:
                    removed.append(name)
                    doomed.append(aside)
        if doomed:
            threading.Thread(
                target=_remove_all, args=(doomed,), name="kv-disk-prune", daemon=True
            ).start()
        return removed

    def _set_aside(self, entry: os.DirEntry, now: float, max_idle_s: float) -> str | None:
        """Rename an idle directory of another fingerprint to REMOVING + its name; the new
        path, or None where it stays."""
        try:
            fd = os.open(os.path.join(entry.path, "lock"), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return None  # not one of ours, or being created: leave it
        except OSError as exc:
            log.warning("KV disk tier: cannot check %s (%s)", entry.path, _reason(exc))
            return None
        aside = os.path.join(self.root, f"{REMOVING}{entry.name}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            idle = now - os.fstat(fd).st_mtime
            if idle < max_idle_s:
                return None
            os.rename(entry.path, aside)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # else in use
                log.warning("KV disk tier: cannot remove %s (%s)", entry.path, _reason(exc))
            return None
        finally:
            os.close(fd)
        log.info(
            "KV disk tier: removing %s, another fingerprint's blocks unused for %.1f days",
            entry.path,
            idle / 86400,
        )
        return aside

    # -- space --------------------------------------------------------------------

    def auto_budget(self, used_bytes: int) -> int:
        """The default budget: min(AUTO_MAX_BYTES, a fraction of free space + what we use)."""
        free = shutil.disk_usage(self.path).free
        return int(min(AUTO_MAX_BYTES, AUTO_FREE_FRACTION * (free + used_bytes)))


def _is_fingerprint(name: str) -> bool:
    return len(name) == FINGERPRINT_HEX and all(c in "0123456789abcdef" for c in name)


def _remove_all(paths: list[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__
