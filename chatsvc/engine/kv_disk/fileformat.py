"""One block per file: the header, the name, and the checks a loaded block must pass.

    offset 0       header (HEADER_STRUCT), then the block's token ids (uint32 LE),
                   zero-padded to header_len (a multiple of 4096)
    header_len     the block's K/V bytes, exactly as one block of the pool
                   ([layers, 2, block_size, kv_heads, head_dim], kernels/kv_layout.py)

so a load is one ``preadv`` into a header buffer and the pool block itself.
The checksum (xxh3-128) covers the header with its checksum field zeroed and
the K/V bytes. The file name repeats what the index needs at start-up
(hash, parent hash, owner digest, shared flag), so rebuilding the index is a
directory listing, never a read of every file; the header is authoritative
and a name that disagrees with it fails the load like any corruption.

Files appear under their final name only by ``rename`` of a complete
temporary file, so no reader ever sees a half-written block; a crash leaves
at most a temporary file, removed at the next start.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from cache.hashing import BlockHasher

MAGIC = b"CKVB"
VERSION = 1
PAGE = 4096
# magic, version, flags, header_len, block_size, data_nbytes,
# fingerprint, hash, parent hash, owner (8 bytes, zero-padded), checksum
HEADER_STRUCT = struct.Struct("<4sHHIIQ16s16s16s16s16s")
_CHECKSUM_AT = HEADER_STRUCT.size - 16
FLAG_SHARED = 1
SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"


class BlockMeta(NamedTuple):
    """What a block file says about itself (from its name or its header)."""

    hash: bytes
    parent_hash: bytes
    owner: bytes
    shared: bool


def header_len(block_size: int) -> int:
    raw = HEADER_STRUCT.size + 4 * block_size
    return -(-raw // PAGE) * PAGE


def file_name(meta: BlockMeta) -> str:
    kind = "p" if meta.shared else "s"
    return f"{meta.hash.hex()}-{meta.parent_hash.hex()}-{meta.owner.hex()}-{kind}{SUFFIX}"


def parse_name(name: str) -> BlockMeta | None:
    """The metadata in a block file's name, or None for anything else."""
    if not name.endswith(SUFFIX):
        return None
    parts = name[: -len(SUFFIX)].split("-")
    if len(parts) != 4 or parts[3] not in ("p", "s"):
        return None
    try:
        hash_, parent, owner = (bytes.fromhex(p) for p in parts[:3])
    except ValueError:
        return None
    if len(hash_) != 16 or len(parent) != 16 or len(owner) not in (0, 8):
        return None
    return BlockMeta(hash_, parent, owner, parts[3] == "p")


def encode_header(
    meta: BlockMeta, token_ids, fingerprint: bytes, data_nbytes: int, data
) -> bytearray:
    """The header bytes (padded to ``header_len``) with the checksum over it and ``data``."""
    block_size = len(token_ids)
    size = header_len(block_size)
    buf = bytearray(size)
    flags = FLAG_SHARED if meta.shared else 0
    HEADER_STRUCT.pack_into(
        buf,
        0,
        MAGIC,
        VERSION,
        flags,
        size,
        block_size,
        data_nbytes,
        fingerprint,
        meta.hash,
        meta.parent_hash,
        meta.owner.ljust(16, b"\0"),
        bytes(16),
    )
    struct.pack_into(f"<{block_size}I", buf, HEADER_STRUCT.size, *token_ids)
    buf[_CHECKSUM_AT : _CHECKSUM_AT + 16] = checksum(buf, data)
    return buf


def checksum(header: bytes | bytearray | memoryview, data) -> bytes:
    """xxh3-128 of the header (checksum field taken as zero) and the K/V bytes."""
    digest = xxhash.xxh3_128()
    view = memoryview(header)
    digest.update(view[:_CHECKSUM_AT])
    digest.update(bytes(16))
    digest.update(view[_CHECKSUM_AT + 16 :])
    digest.update(data)
    return digest.digest()


# Outcomes of ``verify``: a file that is fine but names another block
# ("mismatch", a hash collision) stays; every other failure deletes the file.
OK, CORRUPT, FOREIGN, MISMATCH = "ok", "corrupt", "foreign", "mismatch"


def verify(
    header: bytes | bytearray | memoryview,
    data,
    num_read: int,
    fingerprint: bytes,
    expected_hash: bytes,
    expected_parent: bytes,
    token_ids: tuple[int, ...],
    ns_key: bytes,
    data_nbytes: int,
) -> str:
    """Check a block read from disk before its KV is used; returns OK or the failure."""
    block_size = len(token_ids)
    result = verify_file(
        header, data, num_read, fingerprint, expected_hash, expected_parent, block_size, data_nbytes
    )
    if result != OK:
        return result
    if stored_tokens(header, block_size) != token_ids:
        return MISMATCH
    # The chained hash ties tokens, parent and namespace together: a block of
    # another tenant can never pass, whatever its name says.
    if BlockHasher(block_size).hash_block(expected_parent, token_ids, ns_key) != expected_hash:
        return MISMATCH
    return OK


def verify_file(
    header: bytes | bytearray | memoryview,
    data,
    num_read: int,
    fingerprint: bytes,
    expected_hash: bytes,
    expected_parent: bytes,
    block_size: int,
    data_nbytes: int,
) -> str:
    """The checks of ``verify`` that need no requester: the file is whole (size,
    checksum), of this fingerprint and layout, and is the block its name says.
    Whose block it is (its tokens under the requester's namespace) is ``verify``'s."""
    size = header_len(block_size)
    if num_read != size + data_nbytes or len(header) != size:
        return CORRUPT  # truncated, or longer than a block: not a file we wrote
    (magic, version, _flags, hlen, bs, nbytes, fp, hash_, parent, _owner, stored) = (
        HEADER_STRUCT.unpack_from(header, 0)
    )
    if magic != MAGIC or version != VERSION or hlen != size:
        return CORRUPT
    if stored != checksum(header, data):
        return CORRUPT
    if fp != fingerprint or bs != block_size or nbytes != data_nbytes:
        return FOREIGN
    if hash_ != expected_hash or parent != expected_parent:
        return CORRUPT  # intact but filed under another name
    return OK


def stored_tokens(header: bytes | bytearray | memoryview, block_size: int) -> tuple[int, ...]:
    """The token ids a (verified) header holds."""
    return struct.unpack_from(f"<{block_size}I", header, HEADER_STRUCT.size)
