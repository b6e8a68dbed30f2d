"""The disk KV tier: block files under the data directory, below device and host.

    fingerprint.py   which KV a block file may be loaded into (model, weights, dtype, layout)
    fileformat.py    a block file: header, name, checksum, the checks on load
    directory.py     the tier's directory: modes, lock, start-up scan, default budget
    buffers.py       pool blocks as byte buffers; the snapshot buffers writes go through
    jobs.py          write / readahead / delete / barrier jobs, run on the I/O thread
    load_job.py      a load job: one block from its file (or the preload's copy) into the pool
    loads.py         LoadQueue: the loads of admitted sequences and their results
    worker.py        the I/O thread (loads first, then the rest in order, background last)
    probe.py         the warm-up's load: one scratch block through the load path
    preload.py       after a restart, the most recent chains read into memory while idle
    stats.py         traffic counters and the load latency histogram
    step_io.py       DiskStepIO: the engine-thread side, between cache/ and the files;
                     the engine's StepIO (chatsvc/engine/step_io.py) when the tier is on

The bookkeeping (index, LRU, budget) is ``cache.disk_index``; docs/cache.md
describes the whole tier.
"""

from __future__ import annotations

import logging
from pathlib import Path

from chatsvc.engine.kv_disk.directory import TierDirectory, TierUnavailable, make_private_dir
from chatsvc.engine.kv_disk.fingerprint import model_fingerprint
from chatsvc.engine.kv_disk.step_io import DiskSettings, DiskStepIO

log = logging.getLogger(__name__)

__all__ = ["DiskSettings", "DiskStepIO", "open_disk_tier"]


def open_disk_tier(config, loaded, cache, kv_pool, host_pool, clock=None) -> DiskStepIO | None:
    """The engine's disk tier, or None when it is off or cannot be used here.

    Off when ``config.kv_disk_dir`` is unset, ``kv_disk_bytes`` is 0, or the
    prefix cache is off. A directory that cannot be written (read-only
    filesystem, no permission) or is locked by another process turns it off
    with one log line; the engine serves without it.
    """
    if not config.kv_disk_dir or config.kv_disk_bytes == 0 or not config.enable_prefix_cache:
        return None
    root = Path(config.kv_disk_dir).expanduser()
    model = loaded.model
    shape = model.kv_shape(config.block_size)
    try:
        make_private_dir(root)
        memo = root / "weight-digests.json"
    except OSError:
        memo = None  # reported by TierDirectory.open below
    fingerprint = model_fingerprint(loaded, model.dtype, shape, config.seed, memo, kv_pool.dtype)
    try:
        directory = TierDirectory(root, fingerprint).open()
    except TierUnavailable as exc:
        log.warning("KV disk tier off: %s; serving without it", exc)
        return None
    directory.prune_others(config.kv_disk_keep_other_days * 86400)
    settings = DiskSettings(
        budget_bytes=config.kv_disk_bytes,
        write_through=config.kv_disk_write == "through",
        fsync=config.kv_disk_fsync,
        queue_blocks=config.kv_disk_queue_blocks,
        retry_s=float(config.kv_disk_retry_s),
        load_threads=config.kv_disk_load_threads,
        preload_bytes=config.kv_disk_preload_bytes,
    )
    kwargs = {} if clock is None else {"clock": clock}
    try:
        tier = DiskStepIO(
            cache,
            directory,
            fingerprint,
            config.block_size,
            shape.block_bytes(kv_pool.dtype),
            kv_pool,
            host_pool,
            settings,
            **kwargs,
        )
    except OSError as exc:
        directory.close()
        log.warning("KV disk tier off: %s cannot be read (%s); serving without it", root, exc)
        return None
    log.info(
        "KV disk tier in %s: %d block(s) found, budget %.1f GiB (%s)",
        directory.path,
        tier.num_found,
        tier.index.budget_bytes / 2**30,
        settings.write_through and "write-through" or "write-back",
    )
    return tier
