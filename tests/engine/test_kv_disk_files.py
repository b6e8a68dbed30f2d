"""The disk tier's files without a model: format and checks, directory modes and lock, digests."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kernels
from cache.hashing import ROOT_HASH, BlockHasher
from cache.plan import DiskLoad
from chatsvc.engine.kv_disk.buffers import BufferPool, PoolBlock
from chatsvc.engine.kv_disk.directory import TierDirectory, TierUnavailable
from chatsvc.engine.kv_disk.fileformat import (
    CORRUPT,
    FOREIGN,
    MISMATCH,
    OK,
    BlockMeta,
    file_name,
    header_len,
    parse_name,
)
from chatsvc.engine.kv_disk.fingerprint import weights_digest
from chatsvc.engine.kv_disk.jobs import DeleteJob, WriteJob
from chatsvc.engine.kv_disk.load_job import MISSING, LoadJob
from kernels.kv_layout import KVShape, layer_kv, new_kv_pool
from kernels.kv_quant import quantize_rows
from tests.engine.kv_fs import read_only_dir

BS = 16
FP = b"F" * 16
NS_KEY = b"\x01tenant-salt"
TOKENS = tuple(range(1000, 1000 + BS))
HASH = BlockHasher(BS).hash_block(ROOT_HASH, TOKENS, NS_KEY)
META = BlockMeta(HASH, ROOT_HASH, b"ownerdig", False)
POOL_SHAPE = (4, 2, 2, BS, 3, 64)  # [blocks, layers, K/V, tokens, heads, dim]


def _pool(seed: int = 0) -> torch.Tensor:
    return torch.randn(POOL_SHAPE, generator=torch.Generator().manual_seed(seed))


def _write(directory: TierDirectory, pool: torch.Tensor, block: int = 1) -> Path:
    buffers = BufferPool(1, pool[0].numel() * pool.element_size())
    buffer = buffers.take()
    buffer.tensor.copy_(pool[block].view(torch.uint8).reshape(-1))
    path = directory.block_path(META)
    job = WriteJob(path, META, TOKENS, FP, buffer)
    job.run()
    assert job.error is None and buffers.num_free == 1
    return path


def _load(path: Path, pool: torch.Tensor, tokens=TOKENS, ns_key=NS_KEY, fingerprint=FP) -> str:
    block = 2
    load = DiskLoad(0, block, HASH, ROOT_HASH, tokens, ns_key)
    nbytes = pool[0].numel() * pool.element_size()
    job = LoadJob("seq", 0, load, path, PoolBlock(pool, block), fingerprint, nbytes)
    job.run()
    return job.result


@pytest.fixture
def directory(tmp_path):
    tier = TierDirectory(tmp_path / "kv", FP).open()
    yield tier
    tier.close()


def test_a_written_block_loads_back_bit_for_bit_into_another_pool_block(directory):
    pool = _pool()
    path = _write(directory, pool)
    assert path.stat().st_size == header_len(BS) + pool[0].numel() * 4
    assert parse_name(path.name) == META
    target = torch.zeros(POOL_SHAPE)
    assert _load(path, target) == OK
    assert torch.equal(target[2], pool[1])
    assert not any(p.name.startswith(".tmp-") for p in path.parent.iterdir())


@pytest.mark.parametrize("damage", ["flip_data", "flip_header", "truncate", "extend", "empty"])
def test_a_damaged_file_is_corrupt_and_deleted(directory, damage):
    pool = _pool()
    path = _write(directory, pool)
    data = bytearray(path.read_bytes())
    if damage == "flip_data":
        data[-5] ^= 0x10
    elif damage == "flip_header":
        data[40] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) - 1000]
    elif damage == "extend":
        data += b"\0" * 16
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    assert _load(path, torch.zeros(POOL_SHAPE)) == CORRUPT
    assert not path.exists()


def test_another_fingerprint_is_foreign_and_deleted(directory):
    path = _write(directory, _pool())
    assert _load(path, torch.zeros(POOL_SHAPE), fingerprint=b"G" * 16) == FOREIGN
    assert not path.exists()


def test_other_tokens_or_another_namespace_never_load_but_keep_the_file(directory):
    path = _write(directory, _pool())
    other_tokens = (7,) * BS
    assert _load(path, torch.zeros(POOL_SHAPE), tokens=other_tokens) == MISMATCH
    assert _load(path, torch.zeros(POOL_SHAPE), ns_key=b"\x01another-tenant") == MISMATCH
    assert path.exists()
    path.unlink()
    assert _load(path, torch.zeros(POOL_SHAPE)) == MISSING


def test_names_round_trip_and_reject_strangers():
    assert parse_name(file_name(META)) == META
    shared = BlockMeta(HASH, ROOT_HASH, b"", True)
    assert parse_name(file_name(shared)) == shared
    for name in ("lock", "x.kv", f"{HASH.hex()}-zz-00-s.kv", f"{HASH.hex()}-{HASH.hex()}--q.kv"):
        assert parse_name(name) is None


def test_directories_are_0700_and_files_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        root = tmp_path / "kv"
        root.mkdir(mode=0o777)
        root.chmod(0o777)
        tier = TierDirectory(root, FP).open()
        path = _write(tier, _pool())
    finally:
        os.umask(old)
    for directory in (root, tier.path, path.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    for file in (path, tier.path / "lock"):
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file
    tier.close()


def test_scan_finds_blocks_by_name_and_removes_crashed_writes(directory):
    path = _write(directory, _pool())
    leftover = path.parent / f".tmp-{path.name}.123.0"
    leftover.write_bytes(b"half a block")
    misplaced = directory.path / "00" / path.name
    misplaced.parent.mkdir(mode=0o700, exist_ok=True)
    misplaced.write_bytes(path.read_bytes())
    os.chmod(path, 0o644)  # restored from a backup with looser modes
    found = directory.scan()
    assert [block.meta for block in found] == [META]
    assert not leftover.exists() and not misplaced.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_deleted_block_whose_unlink_failed_is_not_found_at_the_next_start(directory, monkeypatch):
    path = _write(directory, _pool())

    def refuse(target, *args, **kwargs):
        raise PermissionError(13, "refused", str(target))

    with monkeypatch.context() as patch:
        patch.setattr(os, "unlink", refuse)
        job = DeleteJob([path], directory.forgotten)
        job.run()
    assert path.exists() and job.num_deleted == 0 and job.num_failed == 0
    # The next start's rebuild skips the forgotten file and deletes it now.
    assert directory.scan() == [] and not path.exists()
    assert not directory.forgotten.exists()
    path = _write(directory, _pool())  # computed again later: a block like any other
    assert [block.meta for block in directory.scan()] == [META]


def test_a_second_process_on_the_directory_is_refused(directory):
    with pytest.raises(TierUnavailable, match="in use by another process"):
        TierDirectory(directory.root, FP).open()


def _other_tier(root: Path, fingerprint: bytes, idle_days: float) -> TierDirectory:
    """A directory of another fingerprint holding a block, last used ``idle_days`` ago."""
    other = TierDirectory(root, fingerprint).open()
    _write(other, _pool())
    other.close()
    then = time.time() - idle_days * 86400
    os.utime(other.path / "lock", (then, then))
    return other


def test_other_fingerprints_unused_for_the_kept_days_are_removed_at_start(directory):
    root = directory.root
    stale = _other_tier(root, b"S" * 16, idle_days=8)
    recent = _other_tier(root, b"R" * 16, idle_days=2)
    held = _other_tier(root, b"H" * 16, idle_days=30)
    in_use = TierDirectory(root, b"H" * 16).open()  # another process serves from it
    month_ago = time.time() - 30 * 86400
    os.utime(held.path / "lock", (month_ago, month_ago))  # ... since it started a month ago
    interrupted = root / f".removing-{'ab' * 16}"
    (interrupted / "00").mkdir(parents=True)
    (interrupted / "00" / "half-deleted.kv").write_bytes(b"x")
    not_ours = [root / "weight-digests.json", root / "notes", root / ("c" * 31)]
    not_ours[0].write_text("{}")
    not_ours[1].mkdir()
    not_ours[2].mkdir()
    own_blocks = _write(directory, _pool())
    os.utime(directory.path / "lock", (1, 1))  # this process's own: never removed

    assert directory.prune_others(7 * 86400) == [stale.path.name]
    _join_prunes()
    assert not stale.path.exists() and not (root / f".removing-{stale.path.name}").exists()
    assert not interrupted.exists()
    assert recent.path.exists() and held.path.exists() and own_blocks.exists()
    assert all(path.exists() for path in not_ours)
    assert len(recent.scan()) == 1
    # Once the holder lets go it is idle like any other (its close marks it used now).
    in_use.close()
    assert directory.prune_others(7 * 86400) == []
    assert sorted(directory.prune_others(0)) == sorted([recent.path.name, held.path.name])
    _join_prunes()
    assert not recent.path.exists() and not held.path.exists() and own_blocks.exists()


def _join_prunes() -> None:
    for thread in threading.enumerate():
        if thread.name == "kv-disk-prune":
            thread.join(10)


def test_an_unwritable_directory_is_unavailable(tmp_path):
    with read_only_dir(tmp_path / "ro") as ro, pytest.raises(TierUnavailable, match="not writable"):
        TierDirectory(ro / "kv", FP).open()


def test_weights_digest_follows_the_files_and_remembers_them(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = model / "model.safetensors"
    weights.write_bytes(b"w" * 1000)
    loaded = SimpleNamespace(path=model, name="m")
    memo = tmp_path / "memo.json"
    first = weights_digest(loaded, 0, memo)
    assert memo.exists() and weights_digest(loaded, 0, memo) == first
    weights.write_bytes(b"w" * 999 + b"x")
    assert weights_digest(loaded, 0, memo) != first
    random = SimpleNamespace(path=None, name="random:tiny")
    assert weights_digest(random, 0, None) != weights_digest(random, 1, None)


def test_weights_rewritten_with_their_size_and_mtime_kept_are_hashed_again(tmp_path):
    """Regression: the remembered digest was trusted on size and mtime alone, so a
    checkpoint rewritten in place with its mtime set back kept the old fingerprint
    and the disk tier served KV computed with other weights."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = model / "model.safetensors"
    weights.write_bytes(b"w" * 1000)
    before = weights.stat()
    loaded = SimpleNamespace(path=model, name="m")
    memo = tmp_path / "memo.json"
    first = weights_digest(loaded, 0, memo)
    with weights.open("r+b") as f:  # in place: same inode, same size
        f.write(b"x")
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = weights.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    assert weights_digest(loaded, 0, memo) != first


def test_an_int8_block_loads_back_with_its_scales_bit_for_bit(directory):
    """An int8 pool's block file holds its rows and their scales (kv_layout: the scales
    lie inside the block), so a load restores both: a read through the loaded block
    gives the values written."""
    shape = KVShape(2, BS, 3, 64)
    pool = new_kv_pool(4, shape, torch.int8, "cpu")
    key = torch.randn(BS, 3, 64, generator=torch.Generator().manual_seed(3))
    slots = torch.arange(BS, 2 * BS)  # block 1
    for layer in range(2):
        k, v, scales = layer_kv(pool, layer)
        kernels.write_kv(k, v, key * (layer + 1), -key, slots, scales=scales)
    path = _write(directory, pool)
    assert path.stat().st_size == header_len(BS) + shape.block_bytes(torch.int8)
    target = new_kv_pool(4, shape, torch.int8, "cpu")
    assert _load(path, target) == OK
    assert torch.equal(target[2], pool[1])
    k, _, scales = layer_kv(target, 1)
    q, s = quantize_rows(key * 2)
    assert torch.equal(k[2], q) and torch.equal(scales.k[2], s)
