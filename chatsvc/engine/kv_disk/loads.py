"""The loads of admitted sequences: their jobs on the I/O threads, and what came of them.

    submit(loads)   after the step's plans ran (a plan may have held the blocks' old
                    data): per block a LoadJob on the urgent queue, from its file, or
                    from the preload's copy when it holds one (no file read); the files
                    of a sequence get one readahead hint first
    I/O             each block read straight into its pool block (CPU) or through a
                    pinned staging buffer (CUDA), verified (checksum, fingerprint, hash,
                    parent, tokens, namespace)
    done(job)       a later step: the job's result; once all of a sequence's loads
                    ended, the sequence and its verified prefix (``FinishedLoad``)

A file that fails its checks (corrupt, foreign) or vanished leaves the index;
one that names other tokens (a hash collision) stays. Engine thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Items

import torch

from cache.disk_index import DiskIndex
from chatsvc.engine.kv_disk.buffers import BufferPool, PoolBlock, block_bytes
from chatsvc.engine.kv_disk.fileformat import CORRUPT, FOREIGN, OK, BlockMeta
from chatsvc.engine.kv_disk.jobs import PrefetchJob
from chatsvc.engine.kv_disk.load_job import MISSING, LoadGroup, LoadJob
from chatsvc.engine.kv_disk.stats import DiskStats
from chatsvc.engine.step_io import FinishedLoad, SequenceLoads

log = logging.getLogger(__name__)


class _Loading:
    """The loads of one sequence: which finished, and how."""

    __slots__ = ("seq", "results", "remaining")

    def __init__(self, seq, num_loads: int) -> None:
        self.seq = seq
        self.results: list[str | None] = [None] * num_loads
        self.remaining = num_loads

    def num_usable(self) -> int:
        count = 0
        for result in self.results:
            if result != OK:
                break
            count += 1
        return count


class LoadQueue:
    """One tier's loads in flight, by sequence (see the module docstring)."""

    def __init__(
        self,
        index: DiskIndex,
        directory,
        worker,
        kv_pool: torch.Tensor,
        fingerprint: bytes,
        block_nbytes: int,
        file_nbytes: int,
        num_threads: int,
        stats: DiskStats,
    ) -> None:
        self.index = index
        self.directory = directory
        self.worker = worker
        self.kv_pool = kv_pool
        self.fingerprint = fingerprint
        self.block_nbytes = block_nbytes
        self.file_nbytes = file_nbytes
        self.stats = stats
        self.preload = None  # the tier's Preload, when it has one
        self.cuda = kv_pool.device.type == "cuda"
        # One pinned staging buffer per load thread: a load always finds one free.
        self._staging = BufferPool(num_threads, block_nbytes, pin=True) if self.cuda else None
        self._copy_stream = torch.cuda.Stream(kv_pool.device) if self.cuda else None
        self._loading: dict[object, _Loading] = {}

    def __len__(self) -> int:
        """Sequences whose loads have not all ended."""
        return len(self._loading)

    def submit(self, loads: Items[SequenceLoads]) -> list[FinishedLoad]:
        """Queue the step's loads; returns the sequences none of whose blocks is on disk
        any more (evicted since they were matched, in this very step)."""
        ready = None
        if self.cuda and loads:
            ready = torch.cuda.Event()
            ready.record()
        ended = []
        for seq, seq_loads in loads:
            state = _Loading(seq, len(seq_loads))
            self._loading[seq.seq_id] = state
            jobs = []
            for i, load in enumerate(seq_loads):
                entry = self.index.entries.get(load.hash)
                if entry is None:
                    # Evicted from the budget since it was matched, in this very step.
                    state.results[i] = MISSING
                    state.remaining -= 1
                    continue
                meta = BlockMeta(entry.hash, entry.parent_hash, entry.owner, entry.shared)
                path = self.directory.block_path(meta)
                staged = None if self.preload is None else self.preload.take(load.hash)
                jobs.append(self.job(seq.seq_id, i, load, path, ready, staged))
            reads = [job.path for job in jobs if job.staged is None]
            if len(reads) > 1:
                self.worker.submit_urgent(PrefetchJob(reads))
            group = LoadGroup(len(jobs))
            for job in jobs:
                job.group = group
                self.worker.submit_urgent(job)
            if state.remaining == 0:
                ended.append(self._finished(state))
        return ended

    def job(self, seq_id, i: int, load, path, ready=None, staged=None) -> LoadJob:
        """The job that reads ``load`` into its pool block (from ``staged``, the
        preload's copy, when given)."""
        if self.cuda:
            return LoadJob(
                seq_id,
                i,
                load,
                path,
                self._staging,
                self.fingerprint,
                self.block_nbytes,
                device_block=block_bytes(self.kv_pool, load.device_block),
                ready=ready,
                stream=self._copy_stream,
                staged=staged,
            )
        dest = PoolBlock(self.kv_pool, load.device_block)
        return LoadJob(
            seq_id, i, load, path, dest, self.fingerprint, self.block_nbytes, staged=staged
        )

    def done(self, job: LoadJob) -> FinishedLoad | None:
        """Record one load's result; its sequence's outcome once all its loads ended."""
        state = self._loading.get(job.seq_id)
        if state is None:
            return None
        state.results[job.index] = job.result
        state.remaining -= 1
        if job.staged is not None:
            self.preload.release(used=job.result == OK)
        stats = self.stats
        if job.result == OK:
            stats.loaded_blocks += 1
            stats.loaded_bytes += self.file_nbytes
            stats.observe_load(job.latency_s)
        elif job.staged is not None:
            # The preload's copy failed the requester's checks (a hash collision): a
            # miss; the file, checked when read, stays.
            stats.load_misses += 1
        else:
            stats.load_misses += 1
            if job.result in (CORRUPT, FOREIGN):
                stats.dropped[job.result] += 1
                log.warning(
                    "KV disk tier: block %s failed its check (%s); deleted, recomputed",
                    job.load.hash.hex()[:16],
                    job.result,
                )
            if job.result in (CORRUPT, FOREIGN, MISSING):
                self.unindex(job.load.hash)
        return self._finished(state) if state.remaining == 0 else None

    def unindex(self, hash_: bytes) -> None:
        """A block whose file failed a check or vanished: out of the index (and of the
        preload's memory)."""
        self.index.remove(hash_)
        if self.preload is not None:
            self.preload.drop((hash_,))

    def _finished(self, state: _Loading) -> FinishedLoad:
        self._loading.pop(state.seq.seq_id, None)
        return FinishedLoad(state.seq, state.num_usable())
