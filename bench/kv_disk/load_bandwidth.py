"""Disk tier load bandwidth against the disk's own sequential read, in the same run.

    .venv/bin/python -m bench.kv_disk.load_bandwidth [--blocks 1024] [--dtype bf16]
        [--dir DIR] [--cold] [--load-threads 2]

Writes ``--blocks`` block files of the default model's KV shape (random data)
through the tier's own write job, then loads them all as the tier loads one
request's blocks (a readahead hint for every file, then one ``preadv`` per
block into a pool block on the tier's load threads, then the checks: checksum,
fingerprint, hash, parent, tokens), and reads one plain file of the
same total size sequentially (a Python read loop with an 8 MiB buffer, and
``dd`` when present). ``--cold`` drops the page cache before each read
(needs root); otherwise the figures are page-cache reads. ``--dir`` should be
on the disk of interest (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from cache.hashing import ROOT_HASH, BlockHasher
from cache.plan import DiskLoad
from chatsvc.engine.dtype import resolve_dtype
from chatsvc.engine.kv_disk.buffers import BufferPool, PoolBlock, block_bytes
from chatsvc.engine.kv_disk.directory import TierDirectory
from chatsvc.engine.kv_disk.fileformat import OK, BlockMeta, header_len
from chatsvc.engine.kv_disk.jobs import PrefetchJob, WriteJob
from chatsvc.engine.kv_disk.load_job import LoadJob
from chatsvc.engine.kv_disk.worker import IOWorker
from chatsvc.engine.loader import read_config
from chatsvc.engine.weights_gguf import ensure_default_model
from kernels.kv_layout import KVShape, new_kv_pool

FINGERPRINT = b"bench-bandwidth!"
NS_KEY = b"\x01bench"


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def write_blocks(directory: TierDirectory, pool: torch.Tensor, block_size: int):
    hasher = BlockHasher(block_size)
    buffers = BufferPool(8, block_bytes(pool, 0).numel())
    worker = IOWorker("bench-writes")
    loads, parent = [], ROOT_HASH
    start = time.perf_counter()
    for block in range(pool.shape[0]):
        tokens = tuple(range(block * block_size, (block + 1) * block_size))
        hash_ = hasher.hash_block(parent, tokens, NS_KEY)
        meta = BlockMeta(hash_, parent, b"", False)
        while (buffer := buffers.take()) is None:
            worker.wait(0.01)
            worker.take_done()
        buffer.view[:] = memoryview(block_bytes(pool, block).numpy())
        worker.submit(WriteJob(directory.block_path(meta), meta, tokens, FINGERPRINT, buffer))
        loads.append((DiskLoad(block, block, hash_, parent, tokens, NS_KEY), meta))
        parent = hash_
    worker.close()
    return loads, time.perf_counter() - start


def load_blocks(directory, loads, pool, nbytes, threads: int) -> tuple[float, int]:
    worker = IOWorker("bench-loads", num_loaders=threads)
    jobs = []
    for i, (load, meta) in enumerate(loads):
        dest = PoolBlock(pool, load.device_block)
        path = directory.block_path(meta)
        jobs.append(LoadJob("bench", i, load, path, dest, FINGERPRINT, nbytes))
    start = time.perf_counter()
    # As the tier does for one request's blocks: readahead for all, then the loads.
    worker.submit_urgent(PrefetchJob([job.path for job in jobs]))
    for job in jobs:
        worker.submit_urgent(job)
    worker.close()
    elapsed = time.perf_counter() - start
    return elapsed, sum(job.result == OK for job in jobs)


def sequential_file(path: Path, size: int) -> None:
    chunk = os.urandom(8 << 20)
    with path.open("wb") as f:
        left = size
        while left > 0:
            f.write(chunk[: min(left, len(chunk))])
            left -= len(chunk)


def read_loop(path: Path) -> float:
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    start = time.perf_counter()
    with path.open("rb", buffering=0) as f:
        while f.readinto(view):
            pass
    return time.perf_counter() - start


def dd_rate(path: Path) -> str:
    if shutil.which("dd") is None:
        return "n/a (no dd)"
    result = subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=8M"], capture_output=True, text=True
    )
    match = re.search(r"([\d.,]+ [kMGT]?B/s)", result.stderr)
    return match.group(1) if match else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--cold", action="store_true", help="drop the page cache (root)")
    parser.add_argument("--load-threads", type=int, default=2, help="as the tier's default")
    args = parser.parse_args()
    # One torch thread: OpenMP workers spinning after each torch op would take the
    # CPU from the I/O thread being measured (see docs/cache.md, "Disk tier").
    torch.set_num_threads(1)
    config = read_config(ensure_default_model())
    shape = KVShape(config.num_layers, args.block_size, config.num_kv_heads, config.head_dim)
    dtype = resolve_dtype(args.dtype, "cpu")
    nbytes = shape.block_bytes(dtype)
    file_bytes = header_len(args.block_size) + nbytes
    root = Path(args.dir or tempfile.mkdtemp(prefix="kv-bw-"))
    directory = TierDirectory(root / "kv", FINGERPRINT).open()
    try:
        source = new_kv_pool(args.blocks, shape, dtype, "cpu")
        source.copy_(torch.randn(source.shape).to(dtype))
        loads, write_s = write_blocks(directory, source, args.block_size)
        target = new_kv_pool(args.blocks, shape, dtype, "cpu")
        cold = args.cold and drop_caches()
        load_s, num_ok = load_blocks(directory, loads, target, nbytes, args.load_threads)
        exact = torch.equal(source, target)
        total = args.blocks * file_bytes
        plain = root / "sequential.bin"
        sequential_file(plain, total)
        if args.cold:
            drop_caches()
        seq_s = read_loop(plain)
        if args.cold:
            drop_caches()
        dd = dd_rate(plain)
    finally:
        directory.close()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    gb = total / 1e9
    print(
        f"{args.blocks} blocks of {file_bytes / 2**10:.0f} KiB ({shape}, {dtype}), "
        f"{'cold (page cache dropped)' if cold else 'page cache warm'}"
    )
    print(
        f"write through the tier : {args.blocks / write_s:8.0f} blocks/s {gb / write_s:6.2f} GB/s"
    )
    print(
        f"load, {args.load_threads} thread(s)    : {args.blocks / load_s:8.0f} blocks/s "
        f"{gb / load_s:6.2f} GB/s "
        f"({num_ok}/{args.blocks} verified, data {'exact' if exact else 'DIFFERENT'})"
    )
    print(f"sequential read (loop) : {'':>8}          {gb / seq_s:6.2f} GB/s")
    print(f"sequential read (dd)   : {dd}")
    print(f"tier load / sequential read: {seq_s / load_s:.0%}")


if __name__ == "__main__":
    main()
