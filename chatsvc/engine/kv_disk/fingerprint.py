"""The model fingerprint: which KV a disk block may be loaded into.

KV is only reusable by the exact computation that produced it, so the
fingerprint covers everything that changes a block's bytes or their meaning:

    format version | model identity (name and shape) | weights digest
    | dtype | weight layout (int8: and its activations' group) | kernel mode | kernels' code
    | block size | KV layout (kv_layout's dims and their order) | KV dtype and, for int8, its
    scale layout

The weight layout (``kernels.linear``) names how the matrices are stored and summed:
an fp32 model reading bf16-stored weights, or another order of the same sums, writes
other KV bits, and a hit must answer as a miss would; int8 weights multiply x quantized
per group, so the group is part of them. The kernel mode (invariant or
not, ``kernels.invariance``) orders the attention's sums, so it does too, and so does
the code itself (``kernels.backend.arithmetic_identity``: the backend, the native
library's build, torch's version and the ISA its kernels dispatch to): the same step
built for AVX2 or AVX-512, or by another revision of the kernels, writes other bits, so a
tier moved to another CPU or kept across an upgrade starts cold. The KV dtype
(the model's, or int8 rows with their scales: ``kernels.kv_layout``) changes what a
block's bytes mean, and an int8 block's scale layout where they lie: a bf16 engine must
never read an int8 block as values, nor the reverse.

A block written under another fingerprint is never loaded: the tier keeps each
fingerprint's files in a directory of its own, and every file's header
repeats the fingerprint, checked on load.

Weights digests hash the checkpoint files (``*.safetensors`` and
``config.json``); they are remembered per file in a small JSON file so a
restart does not read gigabytes again. A remembered digest is trusted only while
the file's identity is unchanged: its inode, size, mtime and ctime. The mtime
alone can be set back by anyone who rewrites the file (``touch -d``, ``cp -p``,
an unpacked archive), the ctime cannot: any write or ``utime`` moves it. Random-weight models hash
their spec, seed and the torch version that generated them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import torch
import xxhash

from kernels.backend import arithmetic_identity
from kernels.cpu.narrow_linear import ACTIVATION_GROUP
from kernels.kv_layout import SCALE_LAYOUT, KVShape, is_quantized

FORMAT_VERSION = 1
# The order of kv_layout's pool dims; a change there must change this string.
KV_LAYOUT = "block,layer,kv,token,head,dim"
_CHUNK = 8 << 20
log = logging.getLogger(__name__)


def model_fingerprint(
    loaded,
    dtype: torch.dtype,
    kv_shape: KVShape,
    seed: int,
    memo_path: Path | None,
    kv_dtype: torch.dtype | None = None,
) -> bytes:
    """16 bytes naming the model, weights, dtype, weight layout, kernel mode, the kernels'
    code, block size, KV layout and KV dtype (``kv_dtype`` None: ``dtype``)."""
    kv_dtype = kv_dtype or dtype
    identity = {
        "format": FORMAT_VERSION,
        "name": loaded.name,
        "config": dataclasses.asdict(loaded.config),
        "weights": weights_digest(loaded, seed, memo_path),
        "dtype": str(dtype),
        "weight_layout": loaded.model.weight_layout,
        # Invariant kernels order their sums otherwise: other KV bits for the same tokens.
        "invariant": loaded.model.invariant,
        "kernels": arithmetic_identity(loaded.model.device),
        "kv_shape": dataclasses.asdict(kv_shape),
        "kv_layout": KV_LAYOUT,
    }
    if loaded.model.weight_layout == "int8_blocks":
        # int8 weights first summed over x as it was (weight-only): other bits, other files.
        identity["activation_group"] = ACTIVATION_GROUP
    if kv_dtype != dtype:
        # Only when set, so the fingerprints of KV in the model's dtype (and their files)
        # stay as they were.
        identity["kv_dtype"] = str(kv_dtype)
    if is_quantized(kv_dtype):
        identity["kv_scales"] = SCALE_LAYOUT
    blob = json.dumps(identity, sort_keys=True, default=str).encode()
    return xxhash.xxh3_128_digest(blob)


def weights_digest(loaded, seed: int, memo_path: Path | None) -> str:
    """Hex digest of the weights ``loaded`` was built from."""
    if loaded.path is None:
        return f"{loaded.name}:seed={seed}:torch={torch.__version__}"
    directory = Path(loaded.path)
    files = sorted(directory.glob("*.safetensors")) + [directory / "config.json"]
    memo = _read_memo(memo_path)
    digest = xxhash.xxh3_128()
    changed = False
    for path in files:
        if not path.is_file():
            continue
        stat = path.stat()
        key = str(path.resolve())
        identity = [stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]
        known = memo.get(key)
        if known is not None and known[:-1] == identity:
            file_digest = known[-1]
        else:
            file_digest = _file_digest(path)
            memo[key] = [*identity, file_digest]
            changed = True
        digest.update(f"{path.name}:{file_digest};".encode())
    if changed:
        _write_memo(memo_path, memo)
    return digest.hexdigest()


def _file_digest(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _read_memo(memo_path: Path | None) -> dict:
    if memo_path is None:
        return {}
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def _write_memo(memo_path: Path | None, memo: dict) -> None:
    if memo_path is None:
        return
    tmp = memo_path.with_name(f".{memo_path.name}.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(memo, f)
        os.replace(tmp, memo_path)
    except OSError as exc:  # only a cache of digests: the next start recomputes
        log.debug("could not save weight digests to %s: %s", memo_path, exc)
