"""The disk tier's jobs but loads (``load_job.py``), each run once on an I/O thread;
results stay on the job.

A job touches only what it was handed: a snapshot buffer (writes), paths
(readahead hints, deletes). The engine thread reads the results after the
worker lists the job as done.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import Future
from pathlib import Path

from chatsvc.engine.kv_disk.fileformat import TMP_PREFIX, BlockMeta, encode_header

_names = itertools.count()


class WriteJob:
    """Write one block: a temporary file, then a rename to its final name."""

    kind = "write"

    def __init__(
        self,
        path: Path,
        meta: BlockMeta,
        token_ids,
        fingerprint: bytes,
        buffer,
        ready=None,
        fsync: bool = False,
    ) -> None:
        self.path = path
        self.meta = meta
        self.token_ids = token_ids
        self.fingerprint = fingerprint
        self.buffer = buffer  # SnapshotBuffer holding the block's K/V bytes
        self.ready = ready  # a CUDA event the snapshot copy recorded, or None
        self.fsync = fsync
        self.error: OSError | None = None
        self.nbytes = 0

    def run(self) -> None:
        try:
            if self.ready is not None:
                self.ready.synchronize()
            data = self.buffer.view
            header = encode_header(self.meta, self.token_ids, self.fingerprint, len(data), data)
            self.nbytes = len(header) + len(data)
            _write_file(self.path, [header, data], self.fsync)
        except OSError as exc:
            self.error = exc
        finally:
            self.buffer.release()


def _write_file(path: Path, parts: list, fsync: bool) -> None:
    path.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.parent / f"{TMP_PREFIX}{path.name}.{os.getpid()}.{next(_names)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            views = [memoryview(p).cast("B") for p in parts]
            while views:
                written = os.writev(fd, views)
                while views and written >= len(views[0]):
                    written -= len(views[0])
                    views.pop(0)
                if views and written:
                    views[0] = views[0][written:]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        # The rename is what makes the block visible: a reader finds either no
        # file or a complete one.
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class PrefetchJob:
    """Ask the kernel to start reading a request's block files now, all at once.

    The loads then run on the few load threads, but their data is already on
    its way: the disk sees many reads in flight, not one per thread.
    """

    kind = "prefetch"

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    def run(self) -> None:
        for path in self.paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue  # the load reports it
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


class DeleteJob:
    """Delete block files (a missing one is fine).

    The index forgot them already, but the next start rebuilds it from the
    directory: a file whose unlink fails is named in the tier's ``forgotten``
    list (``TierDirectory.forgotten``), which that rebuild skips and retries.
    """

    kind = "delete"

    def __init__(self, paths: list[Path], forgotten: Path) -> None:
        self.paths = paths
        self.forgotten = forgotten
        self.num_deleted = 0
        self.num_failed = 0  # neither unlinked nor listed: the disk refused both

    def run(self) -> None:
        failed = []
        for path in self.paths:
            try:
                os.unlink(path)
                self.num_deleted += 1
            except FileNotFoundError:
                pass
            except OSError:
                failed.append(path.name)
        if failed:
            try:
                fd = os.open(self.forgotten, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    os.write(fd, "".join(f"{name}\n" for name in failed).encode())
                finally:
                    os.close(fd)
            except OSError:
                self.num_failed += len(failed)


class BarrierJob:
    """Completes ``future`` once every job queued before it (in its queue) has run."""

    kind = "barrier"

    def __init__(self) -> None:
        self.future: Future = Future()

    def run(self) -> None:
        if not self.future.done():
            self.future.set_result(None)
