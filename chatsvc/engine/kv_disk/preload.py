"""The preload: after a restart, the most recently used sessions' blocks read into memory
in the background, so that their next turns load them without reading a file.

    start(n)      once the engine serves (after its warm-up): the blocks to read
                  (``DiskIndex.recent_chains``: the chains of the most recently used
                  blocks, each from its root, at most n blocks) and one slab of
                  memory for them (pinned on CUDA)
    pump()        only while the engine has no request: one ``PreloadJob`` at a time
                  reads a few of them on the I/O threads' background queue and gives
                  way, between blocks, to any request's load
    done(job)     each block whose file passed the checks that need no requester
                  (size, checksum, fingerprint, name) is *staged*: kept with its header
    take(hash)    a request's load of a staged block (``DiskStepIO.submit``) runs the
                  load's own checks on the copy (tokens, parent, the chained hash under
                  the requester's namespace) and copies it into the pool block
    drop(hashes)  the block's file left the tier (a deleted session, the budget): its
                  staged copy goes too
    expire(now)   what no request took ``keep_s`` after the preload ended is let go

Why staged and not in the prefix index: a block is indexed with its namespace key,
and a private block's key holds its tenant's secret salt, which the file does not
(deliberately: no salt on disk). Until a request of that tenant asks for the
block, nothing says whose it is. So a staged block is still a block of the disk
tier: a request finds it through the disk index as before, it counts as a disk hit
(``hit_tokens_by_tier["disk"]``, the tier's ``loaded_blocks``), and only the file
read is gone from the request's path. Once loaded it is what any load leaves:
verified, indexed under its chained hash, evictable. Tenant isolation is the load's
own: a request never gets a block a load from the file would not give it.

The preload never takes a block of the pool, so admission, eviction and the memory
tiers' statistics are as without it; its memory is its own, bounded by the setting
(``CHATSVC_KV_DISK_PRELOAD_BYTES``) and given back once nothing is staged.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from cache.disk_index import DiskIndex
from chatsvc.engine.kv_disk.fileformat import (
    CORRUPT,
    FOREIGN,
    OK,
    BlockMeta,
    header_len,
    verify_file,
)
from chatsvc.engine.kv_disk.load_job import MISSING, READ_ERROR, read_file

log = logging.getLogger(__name__)
# Blocks one job reads before the engine thread hears of them (and the next job starts).
BATCH_BLOCKS = 8
# Staged blocks no request took this long after the preload ended are let go: the
# sessions that come back after a restart do so within minutes.
KEEP_S = 600.0


class PlannedBlock(NamedTuple):
    hash: bytes
    parent_hash: bytes
    path: Path
    row: int  # its row of the slab


class StagedBlock:
    """A block read and checked by the preload: its header and a row of the slab."""

    __slots__ = ("hash", "header", "tensor", "view")

    def __init__(self, hash_: bytes, header: bytearray, tensor: torch.Tensor) -> None:
        self.hash = hash_
        self.header = header
        self.tensor = tensor  # a view of the slab: it keeps the slab's memory alive
        self.view = memoryview(tensor.numpy())


class PreloadJob:
    """Read planned blocks into their slab rows, each checked as far as no requester is
    needed; stops before any block once ``should_yield()`` (a request's load waits).

    ``results``: (block, outcome, header) for each block read, in order; the blocks
    after them were not read (the engine thread plans them again).
    """

    kind = "preload"

    def __init__(
        self,
        blocks: list[PlannedBlock],
        slab: torch.Tensor,
        fingerprint: bytes,
        block_size: int,
        should_yield: Callable[[], bool],
    ) -> None:
        self.blocks = blocks
        self.slab = slab
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.should_yield = should_yield
        self.results: list[tuple[PlannedBlock, str, bytearray]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        data_nbytes = self.slab.shape[1]
        for block in self.blocks:
            if self.should_yield():
                return
            header = bytearray(header_len(self.block_size))
            data = memoryview(self.slab[block.row].numpy())
            try:
                num_read = read_file(block.path, header, data)
            except OSError:
                self.results.append((block, READ_ERROR, header))
                continue
            if num_read is None:
                outcome = MISSING
            else:
                outcome = verify_file(
                    header,
                    data,
                    num_read,
                    self.fingerprint,
                    block.hash,
                    block.parent_hash,
                    self.block_size,
                    data_nbytes,
                )
            if outcome in (CORRUPT, FOREIGN):
                try:
                    os.unlink(block.path)  # as a load does: the block is recomputed
                except OSError:
                    pass
            self.results.append((block, outcome, header))


class Preload:
    """One engine's preload (engine thread only; see the module docstring)."""

    def __init__(
        self,
        index: DiskIndex,
        block_path: Callable[[BlockMeta], Path],
        fingerprint: bytes,
        block_size: int,
        data_nbytes: int,
        worker,
        in_memory: Callable[[bytes], bool],
        pin: bool = False,
        keep_s: float = KEEP_S,
    ) -> None:
        self.index = index
        self.block_path = block_path
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.data_nbytes = data_nbytes
        self.worker = worker
        self.in_memory = in_memory
        self.pin = pin
        self.keep_s = keep_s
        self.state = "not started"  # -> "running" -> "done"
        self._plan: deque[PlannedBlock] = deque()
        self._slab: torch.Tensor | None = None
        self._staged: dict[bytes, StagedBlock] = {}
        self._job: PreloadJob | None = None
        self._began = 0.0
        self._ended: float | None = None  # the clock's time when it ended
        self.num_planned = 0
        self.num_read = 0  # blocks staged
        self.num_used = 0  # staged blocks a request's load took and verified
        self.num_dropped = 0  # staged blocks let go unused (expired, file gone, mismatch)
        self.seconds = 0.0

    @property
    def is_active(self) -> bool:
        """Blocks are left to read, or a job is reading some."""
        return self.state == "running"

    @property
    def num_staged(self) -> int:
        return len(self._staged)

    def __contains__(self, hash_: bytes) -> bool:
        """Whether the block is staged (read, and no request took it yet)."""
        return hash_ in self._staged

    def start(self, max_blocks: int, now: float) -> int:
        """Plan the blocks to read (at most ``max_blocks``); returns how many."""
        if self.state != "not started":
            return self.num_planned
        entries = [e for e in self.index.recent_chains(max_blocks) if not self.in_memory(e.hash)]
        self.num_planned = len(entries)
        if not entries:
            self._end(now)
            return 0
        self._slab = torch.empty(
            (len(entries), self.data_nbytes), dtype=torch.uint8, pin_memory=self.pin
        )
        for row, e in enumerate(entries):
            path = self.block_path(BlockMeta(e.hash, e.parent_hash, e.owner, e.shared))
            self._plan.append(PlannedBlock(e.hash, e.parent_hash, path, row))
        self.state = "running"
        self._began = time.perf_counter()
        log.info(
            "KV disk tier: preloading the %d most recently used block(s) (%.0f MiB) while "
            "the engine is idle",
            len(entries),
            len(entries) * self.data_nbytes / 2**20,
        )
        return len(entries)

    def pump(self, now: float) -> None:
        """Start the next job unless one is running (only while no request is in the
        engine: a request's steps and loads go first)."""
        if self.state != "running" or self._job is not None:
            return
        blocks = []
        while self._plan and len(blocks) < BATCH_BLOCKS:
            block = self._plan.popleft()
            # Gone from the tier since it was planned, or brought to memory by a request.
            if block.hash in self.index.entries and not self.in_memory(block.hash):
                blocks.append(block)
        if not blocks:
            self._end(now)
            return
        self._job = PreloadJob(
            blocks,
            self._slab,
            self.fingerprint,
            self.block_size,
            lambda: self.worker.has_urgent,
        )
        self.worker.submit_background(self._job)

    def done(self, job: PreloadJob, now: float) -> list[tuple[bytes, str]]:
        """Stage what the job read; returns (hash, outcome) of the files that failed their
        checks or were missing (the caller takes them out of the tier's index)."""
        self._job = None
        if self.state != "running":  # stopped meanwhile
            self._free_slab()
            return []
        failed = []
        for block, outcome, header in job.results:
            if outcome == OK and block.hash in self.index.entries:
                self._staged[block.hash] = StagedBlock(block.hash, header, self._slab[block.row])
                self.num_read += 1
            elif outcome in (CORRUPT, FOREIGN, MISSING):
                failed.append((block.hash, outcome))
        if job.error is not None:
            self._plan.clear()  # a bug in the job: do not run it again
        else:
            self._plan.extendleft(reversed(job.blocks[len(job.results) :]))
        if not self._plan:
            self._end(now)
        return failed

    def take(self, hash_: bytes) -> StagedBlock | None:
        """A request's load of ``hash_``: its staged copy, which the load now owns."""
        return self._staged.pop(hash_, None)

    def release(self, used: bool) -> None:
        """A load that took a staged copy ended (``used``: verified into the pool)."""
        if used:
            self.num_used += 1
        else:
            self.num_dropped += 1
        self._free_slab()

    def drop(self, hashes) -> None:
        """The blocks left the tier: their staged copies go too."""
        for hash_ in hashes:
            if self._staged.pop(hash_, None) is not None:
                self.num_dropped += 1
        self._free_slab()

    def expire(self, now: float) -> None:
        if self._staged and self._ended is not None and now >= self._ended + self.keep_s:
            self.num_dropped += len(self._staged)
            self._staged.clear()
            self._free_slab()

    def stop(self, now: float) -> None:
        """Read nothing more and let go of what is staged (the engine closes)."""
        self._plan.clear()
        self.drop(list(self._staged))
        if self.state == "running":
            self._end(now)

    def snapshot(self) -> dict:
        return {
            "state": self.state,
            "planned_blocks": self.num_planned,
            "read_blocks": self.num_read,
            "staged_blocks": len(self._staged),
            "used_blocks": self.num_used,
            "dropped_blocks": self.num_dropped,
            "seconds": round(self.seconds, 3),
        }

    def _end(self, now: float) -> None:
        if self.state == "running":
            self.seconds = time.perf_counter() - self._began
            log.info(
                "KV disk tier: preloaded %d of %d block(s) in %.2f s",
                self.num_read,
                self.num_planned,
                self.seconds,
            )
        self.state = "done"
        self._ended = now
        self._free_slab()

    def _free_slab(self) -> None:
        # Loads still copying from a row hold a view of it, which keeps the memory alive.
        if self.state == "done" and not self._staged and self._job is None:
            self._slab = None
