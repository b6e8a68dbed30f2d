"""The disk tier's jobs, each run once on the I/O thread; results stay on the job.

A job touches only what it was handed: a snapshot buffer (writes), the pool
block its sequence holds while it loads (loads), paths (deletes). The engine
thread reads the results after the worker lists the job as done.
"""

from __future__ import annotations

import itertools
import os
import time
from concurrent.futures import Future
from pathlib import Path

from cache.plan import DiskLoad
from chatsvc.engine.kv_disk.fileformat import (
    CORRUPT,
    FOREIGN,
    OK,
    TMP_PREFIX,
    BlockMeta,
    encode_header,
    header_len,
    verify,
)

MISSING, READ_ERROR = "missing", "read_error"
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


class LoadGroup:
    """The loads of one sequence: the I/O threads count them down (under their lock)."""

    __slots__ = ("remaining",)

    def __init__(self, count: int) -> None:
        self.remaining = count


class LoadJob:
    """Read one block into the pool block its sequence holds, and verify it.

    On a CPU pool ``dest`` is the pool block's own memory: one ``preadv`` fills
    the header buffer and the block. With a CUDA pool ``dest`` is a pool of
    pinned staging buffers (one per load thread, so one is always free): the
    block is read into one, and copied to ``device_block`` on the worker's
    stream once verified (after ``ready``: the step's plans, which may have held
    the block's previous data, ran first).
    """

    kind = "load"

    def __init__(
        self,
        seq_id,
        index: int,
        load: DiskLoad,
        path: Path,
        dest,
        fingerprint: bytes,
        data_nbytes: int,
        device_block=None,
        ready=None,
        stream=None,
    ) -> None:
        self.seq_id = seq_id
        self.index = index
        self.load = load
        self.path = path
        self.dest = dest
        self.fingerprint = fingerprint
        self.data_nbytes = data_nbytes
        self.device_block = device_block
        self.ready = ready
        self.stream = stream
        self.group: LoadGroup | None = None
        self.result = READ_ERROR
        self.error: OSError | None = None
        self.submitted = time.perf_counter()
        self.latency_s = 0.0

    def run(self) -> None:
        try:
            self.result = self._read()
        except OSError as exc:
            self.error = exc
            self.result = READ_ERROR
        self.latency_s = time.perf_counter() - self.submitted

    def _read(self) -> str:
        if self.device_block is None:
            return self._read_into(self.dest)
        staging = self.dest.take()
        try:
            return self._read_into(staging)
        finally:
            staging.release()

    def _read_into(self, dest) -> str:
        load = self.load
        header = bytearray(header_len(len(load.token_ids)))
        data = dest.view
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return MISSING
        try:
            size = os.fstat(fd).st_size
            num_read = os.preadv(fd, [header, data], 0)
        finally:
            os.close(fd)
        result = verify(
            header,
            data,
            num_read if size == num_read else -1,
            self.fingerprint,
            load.hash,
            load.parent_hash,
            load.token_ids,
            load.ns_key,
            self.data_nbytes,
        )
        if result in (CORRUPT, FOREIGN):
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            return result
        if result != OK:
            return result
        if self.device_block is not None:
            self._to_device(dest)
        try:
            os.utime(self.path)  # the block's recency survives a restart
        except OSError:
            pass
        return OK

    def _to_device(self, staging) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            if self.ready is not None:
                self.stream.wait_event(self.ready)
            self.device_block.copy_(staging.tensor, non_blocking=True)
        self.stream.synchronize()


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
