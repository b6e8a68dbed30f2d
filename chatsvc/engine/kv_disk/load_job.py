"""A load job: one block read from its file (or the preload's copy) into its pool block
and verified, on an I/O thread; the result stays on the job.

A load touches only the pool block its sequence holds while it loads (the
scheduler never schedules a LOADING sequence), and on CUDA one of the pinned
staging buffers; the engine thread reads the result once the worker lists the
job as done (``LoadQueue.done``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from cache.plan import DiskLoad
from chatsvc.engine.kv_disk.fileformat import CORRUPT, FOREIGN, OK, header_len, verify

MISSING, READ_ERROR = "missing", "read_error"


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

    ``staged``: the block is already in memory, read by the preload
    (``kv_disk/preload.py``): the same checks run on that copy, which is then
    copied into the pool block (on CUDA from its pinned memory); the file is
    not read.
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
        staged=None,
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
        self.staged = staged
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
        if self.staged is not None:
            return self._from_staged()
        if self.device_block is None:
            return self._read_into(self.dest)
        staging = self.dest.take()
        try:
            return self._read_into(staging)
        finally:
            staging.release()

    def _read_into(self, dest) -> str:
        header = bytearray(header_len(len(self.load.token_ids)))
        data = dest.view
        num_read = read_file(self.path, header, data)
        if num_read is None:
            return MISSING
        result = self._verify(header, data, num_read)
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
        self._touch()
        return OK

    def _from_staged(self) -> str:
        staged = self.staged
        # The file passed these checks when the preload read it; a copy that fails
        # them now is dropped, and the file is left as it is.
        result = self._verify(staged.header, staged.view, len(staged.header) + len(staged.view))
        if result != OK:
            return result
        if self.device_block is not None:
            self._to_device(staged)
        else:
            self.dest.view[:] = staged.view
        self._touch()
        return OK

    def _verify(self, header, data, num_read: int) -> str:
        load = self.load
        return verify(
            header,
            data,
            num_read,
            self.fingerprint,
            load.hash,
            load.parent_hash,
            load.token_ids,
            load.ns_key,
            self.data_nbytes,
        )

    def _touch(self) -> None:
        try:
            os.utime(self.path)  # the block's recency survives a restart
        except OSError:
            pass

    def _to_device(self, staging) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            if self.ready is not None:
                self.stream.wait_event(self.ready)
            self.device_block.copy_(staging.tensor, non_blocking=True)
        self.stream.synchronize()


def read_file(path: Path, header, data) -> int | None:
    """One ``preadv`` of a block file into ``header`` and ``data``: the bytes read, -1
    when the file is not exactly that long, None when it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        num_read = os.preadv(fd, [header, data], 0)
    finally:
        os.close(fd)
    return num_read if size == num_read else -1
