"""DiskStepIO: the disk tier on the engine thread, the engine's StepIO when it is on.

It sits between the cache's bookkeeping (``cache.disk_index``) and the files,
and sees the engine only through the StepIO seam (``chatsvc.engine.step_io``):
loads it is handed, stores it is given, finished loads it hands back. Writes and
loads are jobs for the I/O threads (``worker``), whose results are taken in at
the start of the next step; the step loop never waits for them.

    step N   scheduler admits a prompt whose match continues on disk: its blocks
             are allocated, the sequence waits in LOADING (``cache.allocate`` ->
             loads); after the step's plans ran, the loads are queued
             (``submit``: a plan may have held those blocks' old data)
    I/O      on the load threads, each block read straight into its pool block
             (CPU) or through a pinned buffer (CUDA), verified (checksum,
             fingerprint, hash, parent, tokens, namespace): ``loads.py``
    step N+k ``finished_loads``: the sequence and its verified prefix, which the
             scheduler counts as computed; it runs and prefills only the rest

After a restart, once the engine serves, the most recently used chains are read
into memory while no request runs (``preload.py``, started by ``start_preload``
and driven by ``idle``); a load of such a block then reads no file.

Writes: write-through stores every newly indexed block once, right after the
step that computed it; in both modes a block dropped from the memory tiers
that is not on disk yet is stored by the plan that drops it (before the block
is reused). A store copies the block into one of a fixed set of snapshot
buffers; with none free it is dropped (``queue_full``), never waited for.

Write errors (disk full, I/O errors) stop writes for ``retry_s`` with one
warning; serving goes on, and the first write after the pause that succeeds
resumes them (logged once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Items
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from cache import KVCacheManager
from cache.disk_index import DiskIndex
from cache.namespace import PUBLIC_KEY
from cache.plan import BlockStore
from chatsvc.engine.kv_disk.buffers import BufferPool, block_bytes
from chatsvc.engine.kv_disk.directory import TierDirectory
from chatsvc.engine.kv_disk.fileformat import CORRUPT, FOREIGN, BlockMeta, header_len
from chatsvc.engine.kv_disk.jobs import BarrierJob, DeleteJob, WriteJob
from chatsvc.engine.kv_disk.loads import LoadQueue
from chatsvc.engine.kv_disk.preload import Preload, PreloadJob
from chatsvc.engine.kv_disk.probe import probe_load
from chatsvc.engine.kv_disk.stats import DiskStats
from chatsvc.engine.kv_disk.worker import IOWorker
from chatsvc.engine.step_io import FinishedLoad, SequenceLoads

log = logging.getLogger(__name__)
BUDGET_RECHECK_S = 30.0


@dataclass(frozen=True)
class DiskSettings:
    """How the tier behaves (from EngineConfig's kv_disk_* fields)."""

    budget_bytes: int | None = None  # None: the automatic budget, re-checked as it runs
    write_through: bool = True
    fsync: bool = False
    queue_blocks: int = 64  # snapshot buffers: stores in flight at most
    retry_s: float = 10.0  # pause of writes after a write error
    load_threads: int = 2  # I/O threads that read blocks (the first also runs the writes)
    preload_bytes: int = 0  # at most this much of the blocks read into memory after a restart


class DiskStepIO:
    """One engine's disk tier, a ``StepIO`` (see the module docstring)."""

    def __init__(
        self,
        cache: KVCacheManager,
        directory: TierDirectory,
        fingerprint: bytes,
        block_size: int,
        block_nbytes: int,
        kv_pool: torch.Tensor,
        host_pool: torch.Tensor | None,
        settings: DiskSettings,
        clock=time.time,
    ) -> None:
        self.cache = cache
        self.directory = directory
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.block_nbytes = block_nbytes
        self.file_nbytes = header_len(block_size) + block_nbytes
        self.kv_pool = kv_pool
        self.host_pool = host_pool
        self.settings = settings
        self.clock = clock
        self.cuda = kv_pool.device.type == "cuda"
        self.stats = DiskStats()
        self.worker = IOWorker(num_loaders=settings.load_threads)
        self.buffers = BufferPool(settings.queue_blocks, block_nbytes, pin=self.cuda)
        self._paused_until: float | None = None
        self._next_budget_check = 0.0
        self.index = DiskIndex(self.file_nbytes, settings.budget_bytes or 0)
        self.num_found = self._rebuild()
        cache.attach_disk(self.index, clock, settings.write_through)
        self.loads = LoadQueue(
            self.index,
            directory,
            self.worker,
            kv_pool,
            fingerprint,
            block_nbytes,
            self.file_nbytes,
            settings.load_threads,
            self.stats,
        )
        self.preload: Preload | None = None
        if settings.preload_bytes >= self.file_nbytes:
            self.preload = self.loads.preload = Preload(
                self.index,
                directory.block_path,
                fingerprint,
                block_size,
                block_nbytes,
                self.worker,
                cache.tiers.index.is_occupied,
                pin=self.cuda,
            )

    def use_clock(self, clock) -> None:
        """Take recency and pauses from ``clock`` (tests and benchmarks step time)."""
        self.clock = clock
        self.cache._clock = clock  # noqa: SLF001 - the manager's disk recency, same source

    # -- start-up -----------------------------------------------------------------

    def _rebuild(self) -> int:
        found = self.directory.scan()
        index = self.index
        index.budget_bytes = self._budget(len(found) * self.file_nbytes)
        for block in found:
            meta = block.meta
            index.add(meta.hash, meta.parent_hash, meta.owner, meta.shared, block.mtime)
        self._delete(index.set_budget(index.budget_bytes))
        return len(index)

    def _budget(self, used_bytes: int) -> int:
        if self.settings.budget_bytes is not None:
            return self.settings.budget_bytes
        self._next_budget_check = self.clock() + BUDGET_RECHECK_S
        return self.directory.auto_budget(used_bytes)

    # -- the step loop (StepIO) ----------------------------------------------------

    @property
    def has_unapplied_io(self) -> bool:
        """Writes queued whose results this thread has not taken in (``finished_loads``):
        until then their blocks count as writing and their buffers are not free; or a
        preload under way, which only goes on while this thread calls ``idle``."""
        preloading = self.preload is not None and self.preload.is_active
        return bool(self.index.writing) or preloading

    def finished_loads(self) -> list[FinishedLoad]:
        """Apply finished jobs: writes join the index; returns the sequences whose loads
        all ended."""
        finished = []
        for job in self.worker.take_done():
            if job.kind == "write":
                self._write_done(job)
            elif job.kind == "load":
                ended = self.loads.done(job)
                if ended is not None:
                    finished.append(ended)
            elif job.kind == "preload":
                self._preload_done(job)
        if self.preload is not None:
            self.preload.expire(self.clock())
        if self.settings.budget_bytes is None and self.clock() >= self._next_budget_check:
            budget = self._budget(self.index.used_bytes)
            self._delete(self.index.set_budget(budget))
        return finished

    def submit(self, loads: Items[SequenceLoads]) -> list[FinishedLoad]:
        """Queue the step's disk loads; called once the step's plans have run.

        Returns the sequences none of whose blocks is on disk any more (evicted
        since they were matched, in this very step): they ended without I/O.
        """
        return self.loads.submit(loads)

    def snapshot(self, pool: torch.Tensor, block: int):
        """A copy of a pool block in a snapshot buffer: (buffer, CUDA event or None), or
        None when no buffer is free."""
        buffer = self.buffers.take()
        if buffer is None:
            return None
        source = block_bytes(pool, block)
        ready = None
        if source.is_cuda:
            buffer.tensor.copy_(source, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            # A plain memcpy: a torch copy this size wakes its OpenMP team, whose
            # spinning workers then starve the I/O thread on a small machine.
            buffer.view[:] = memoryview(source.numpy())
        return buffer, ready

    def store(self, stores: Items[BlockStore]) -> None:
        """Snapshot blocks and queue their writes; drops what cannot be stored now."""
        index = self.index
        if self.cuda and any(store.location == "host" for store in stores):
            # Pinned host blocks may still be landing from an earlier swap-out on the
            # swap stream (the compute stream waits for it): read them once it is done.
            torch.cuda.current_stream(self.kv_pool.device).synchronize()
        for store in stores:
            if self._paused_until is not None and self.clock() < self._paused_until:
                self.stats.dropped["write_error"] += 1
                continue
            reservation = index.reserve(
                store.hash, store.parent_hash, store.owner, store.shared, store.owners
            )
            self._delete(reservation.evicted)
            if not reservation.granted:
                continue  # already stored or queued, or refused by the budget (counted)
            pool = self.kv_pool if store.location == "device" else self.host_pool
            snapshot = self.snapshot(pool, store.block_id)
            if snapshot is None:
                index.finish_write(store.hash, self.clock(), ok=False)
                self.stats.dropped["queue_full"] += 1
                continue
            buffer, ready = snapshot
            meta = BlockMeta(store.hash, store.parent_hash, store.owner, store.shared)
            job = WriteJob(
                self.directory.block_path(meta),
                meta,
                store.token_ids,
                self.fingerprint,
                buffer,
                ready,
                self.settings.fsync,
            )
            self.worker.submit(job)

    def wait(self, timeout_s: float) -> None:
        self.worker.wait(timeout_s)

    def idle(self) -> None:
        """The engine has no request: the preload may read on."""
        if self.preload is not None:
            self.preload.pump(self.clock())

    # -- start-up: the warm-up's load, the preload -----------------------------------

    def warm_up_load(self, timeout_s: float) -> str:
        """One block through the load path before the engine serves (``kv_disk/probe.py``);
        "ok" or what failed. Changes nothing the cache, the tier or its statistics hold."""
        free = self.cache.tiers.device.free_block_ids()
        if not free:
            return "no free block"
        return probe_load(self, free[-1], timeout_s)

    def start_preload(self) -> int:
        """Read the most recently used chains into memory in the background, up to the
        setting's bytes and the pool's size (``kv_disk/preload.py``); blocks planned."""
        if self.preload is None:
            return 0
        max_blocks = min(self.settings.preload_bytes // self.file_nbytes, self.kv_pool.shape[0])
        planned = self.preload.start(max_blocks, self.clock())
        self.preload.pump(self.clock())
        return planned

    # -- results ------------------------------------------------------------------

    def _write_done(self, job: WriteJob) -> None:
        ok = job.error is None
        self.index.finish_write(job.meta.hash, self.clock(), ok)
        if ok:
            self.stats.stored_blocks += 1
            self.stats.stored_bytes += job.nbytes
            if self._paused_until is not None:
                self._paused_until = None
                log.info("KV disk tier: writes resumed in %s", self.directory.path)
            return
        self.stats.write_errors += 1
        self.stats.dropped["write_error"] += 1
        if self._paused_until is None:
            log.warning(
                "KV disk tier: writing to %s failed (%s); writes stop for %.0f s and resume "
                "when one succeeds; serving continues",
                self.directory.path,
                job.error,
                self.settings.retry_s,
            )
        self._paused_until = self.clock() + self.settings.retry_s

    def _preload_done(self, job: PreloadJob) -> None:
        for hash_, result in self.preload.done(job, self.clock()):
            if result in (CORRUPT, FOREIGN):
                self.stats.dropped[result] += 1
                log.warning(
                    "KV disk tier: block %s failed its check (%s) in the preload; deleted",
                    hash_.hex()[:16],
                    result,
                )
            self.loads.unindex(hash_)

    # -- deletion, shutdown, statistics --------------------------------------------

    def forget(
        self, token_ids, namespace, owner: bytes, keep_tokens: int = 0, owned_below: bool = True
    ):
        """Remove a conversation's blocks (``KVCacheManager.forget``) and delete their files.

        Returns the counts and a future that completes once the files are gone.
        """
        result = self.cache.forget(token_ids, namespace, owner, keep_tokens, owned_below)
        self.stats.deleted_blocks += len(result.disk_blocks)
        done = self._delete(result.disk_blocks, barrier=True)
        counts = {
            "device": result.device_blocks,
            "host": result.host_blocks,
            "disk": len(result.disk_blocks),
            "kept": result.kept_blocks,
        }
        return counts, done

    def _delete(self, entries, barrier: bool = False) -> Future | None:
        if entries and self.preload is not None:
            self.preload.drop(e.hash for e in entries)
        if entries:
            paths = [
                self.directory.block_path(BlockMeta(e.hash, e.parent_hash, e.owner, e.shared))
                for e in entries
            ]
            self.worker.submit(DeleteJob(paths, self.directory.forgotten))
        if not barrier:
            return None
        job = BarrierJob()
        self.worker.submit(job)
        return job.future

    def close(self) -> None:
        """Store what only the memory tiers hold, finish queued jobs, release the directory."""
        if self.preload is not None:
            self.preload.stop(self.clock())
        try:
            self._flush()
        finally:
            self.worker.close()
            self.directory.close()

    def _flush(self) -> None:
        # Write-back keeps blocks in memory until they are dropped; at a clean
        # shutdown they go to disk so the next start is warm. Write-through has
        # only the stores it had to drop left to do.
        index = self.cache.tiers.index
        for node in list(index.walk()):
            if self._paused_until is not None:
                return
            if self.index.is_stored_or_writing(node.hash):
                continue
            while self.buffers.num_free == 0:
                self.worker.wait(0.05)
                for job in self.worker.take_done():
                    if job.kind == "write":
                        self._write_done(job)
            self.store(
                [
                    BlockStore(
                        node.location,
                        node.block_id,
                        node.hash,
                        node.parent.hash,
                        node.token_ids,
                        node.ns_key == PUBLIC_KEY,
                        node.owner,
                        frozenset(node.owners),
                    )
                ]
            )

    def stats_snapshot(self) -> dict:
        index = self.index
        snapshot = self.stats.snapshot()
        snapshot["dropped_blocks"]["budget"] = index.num_evicted + index.num_refused
        snapshot.update(
            {
                "dir": str(self.directory.path),
                "write_mode": "through" if self.settings.write_through else "back",
                "blocks": len(index),
                # In blocks, like the memory tiers' "total" and "free".
                "total": index.budget_bytes // self.file_nbytes,
                "free": max(0, index.budget_bytes - index.used_bytes) // self.file_nbytes,
                "used_bytes": index.used_bytes,
                "budget_bytes": index.budget_bytes,
                "writes_paused": self._paused_until is not None,
                "queued_jobs": self.worker.num_queued,
                "loading_sequences": len(self.loads),
            }
        )
        if self.preload is not None:
            snapshot["preload"] = self.preload.snapshot()
        return snapshot
