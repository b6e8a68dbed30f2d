"""The warm-up's disk load: one block through the tier's load path before the engine serves.

A fresh process pays first-call costs in its first load too: the I/O thread's
first job, the first ``preadv`` into the pool, the checksum's and the checks'
first calls, on CUDA the pinned staging buffer and the copy stream. The warm-up
(``engine/warmup.py``) pays them here, with the engine's own jobs: a ``WriteJob``
writes one synthetic block (token ids 0..block_size-1 in the public namespace,
chained from the root) to a scratch name in the tier's directory, a ``LoadJob``
reads it back into a free block of the pool with every check a request's load
runs, and the file is deleted.

Nothing changes: the file holds that very pool block's bytes (a snapshot first,
as a store takes), so the load writes back exactly what was there; the block is
never allocated; the disk index never hears of the file, and the scratch name is
one the start-up scan removes if a crash leaves it (``TierDirectory.scratch_path``).
The jobs' results are not handed to the tier's statistics (``ProbeJob`` is a kind
``finished_loads`` ignores).
"""

from __future__ import annotations

import os
import threading

from cache.hashing import ROOT_HASH, BlockHasher
from cache.namespace import PUBLIC_KEY
from cache.plan import DiskLoad
from chatsvc.engine.kv_disk.fileformat import OK, BlockMeta
from chatsvc.engine.kv_disk.jobs import WriteJob
from chatsvc.engine.kv_disk.load_job import LoadJob


class ProbeJob:
    """Write, load back and delete one scratch block file, on one I/O thread."""

    kind = "probe"

    def __init__(self, write: WriteJob, load: LoadJob) -> None:
        self.write = write
        self.load = load
        self.outcome = "failed"
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.write.run()
            if self.write.error is not None:
                self.outcome = f"write failed: {_reason(self.write.error)}"
                return
            self.load.run()
            if self.load.error is not None:
                self.outcome = f"read failed: {_reason(self.load.error)}"
            else:
                self.outcome = self.load.result
        finally:
            try:
                os.unlink(self.write.path)
            except OSError:
                pass
            self.done.set()


def probe_load(tier, block: int, timeout_s: float) -> str:
    """Run the probe through ``tier`` (a DiskStepIO: its snapshot buffers, its loads'
    jobs, its I/O threads) into pool block ``block``; "ok" or what failed. Waits at
    most ``timeout_s`` (the job cleans up after itself later)."""
    tokens = tuple(range(tier.block_size))
    hash_ = BlockHasher(tier.block_size).hash_block(ROOT_HASH, tokens, PUBLIC_KEY)
    path = tier.directory.scratch_path("warm-up")
    snapshot = tier.snapshot(tier.kv_pool, block)
    if snapshot is None:
        return "no snapshot buffer free"
    buffer, ready = snapshot
    meta = BlockMeta(hash_, ROOT_HASH, b"", True)
    write = WriteJob(path, meta, tokens, tier.fingerprint, buffer, ready)
    load = tier.loads.job(None, 0, DiskLoad(0, block, hash_, ROOT_HASH, tokens, PUBLIC_KEY), path)
    job = ProbeJob(write, load)
    tier.worker.submit_urgent(job)
    if not job.done.wait(timeout_s):
        return "timed out"
    return "ok" if job.outcome == OK else job.outcome


def _reason(error: BaseException) -> str:
    return getattr(error, "strerror", None) or type(error).__name__
