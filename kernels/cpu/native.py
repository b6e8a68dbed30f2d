"""Build and load the C kernels (``kernels/cpu/*.c``) the CPU path runs.

They are compiled on first use with the machine's C compiler (``$CC``, else
``gcc``) for this CPU (``-march=native``) and cached as a shared library in the
build directory (``set_build_dir``: the engine passes ``kernels/`` of the
service's data directory; default ``~/.cache/chatsvc/kernels``), named by a hash
of the sources, the flags, the compiler (where it resolves, its version) and the
CPU, so an edit, another compiler or another machine builds afresh. Concurrent
builders each write a temporary file and rename it into place.

Where no compiler works, ``library()`` returns None once it has logged why, and
the kernels fall back to the torch reference (``kernels.backend``).

Loading a shared library runs its code inside the service, so a cached one is
loaded only if it and its directory belong to this user and nobody else can
write to them (the directory is created 0700). A cached file that fails the
check is replaced by a fresh build; a directory that fails it (another user's)
is not used at all: the kernels then run on torch, and the log says why. The
loaded library's sha256 is logged and kept (``library_sha256()``), so an
operator can tell which build runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

# torch first: its bundled libgomp (soname libgomp.so.1) is then the one our
# library binds to, so both share one OpenMP thread team.
import torch

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "attention.c",
        "attention_plan.c",
        "attention_merge.c",
        "attention_portable.c",
        "attention_avx2.c",
        "attention_avx512.c",
        "attention_bf16.c",
        "attention_int8.c",
        "attention_amx.c",
        "write_kv.c",
        "layers.c",
        "tile_linear.c",
        "narrow_linear.c",
        "narrow_linear_avx512.c",
        "narrow_int8.c",
        "narrow_pack.c",
        "pair_linear.c",
        "decoder.c",
    )
)
# Included by the sources: in the key.
HEADERS = tuple(
    Path(__file__).with_name(name)
    for name in (
        "common.h",
        "exports.h",
        "amx.h",
        "attention.h",
        "attention_walk.h",
        "narrow_linear.h",
    )
)
LIBRARY = "chatsvc_kernels"
# No -ffast-math: the kernel relies on -inf comparisons; -fno-trapping-math lets floorf inline.
BASE_FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    # A call without a prototype builds with a guessed signature (older gcc only warn).
    "-Werror=implicit-function-declaration",
    "-fPIC",
    "-shared",
]
BUILD_TIMEOUT_S = 120
# The C kernels' dtype argument (common.h), and the attention's KV dtype argument.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
KV_DTYPE_CODES = {**DTYPE_CODES, torch.int8: 2}

_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None
_loaded_sha256: str | None = None
_error: str | None = None
PRIVATE_DIR_MODE = 0o700
# Group or other write on a library or its directory lets someone else swap the code.
_FOREIGN_WRITE = stat.S_IWGRP | stat.S_IWOTH
DEFAULT_BUILD_DIR = Path("~/.cache/chatsvc/kernels")
_build_dir: Path | None = None


def set_build_dir(path: str | os.PathLike[str] | None) -> None:
    """Build and cache the library under ``path`` from now on (None: the default,
    ``~/.cache/chatsvc/kernels``). A library already loaded stays the one in use."""
    global _build_dir
    _build_dir = None if path is None else Path(path).expanduser()


def build_dir() -> Path:
    """Where ``build`` puts the library (``set_build_dir``)."""
    return _build_dir if _build_dir is not None else DEFAULT_BUILD_DIR.expanduser()


def default_flags() -> list[str]:
    """Compiler flags of the library ``library()`` loads."""
    if platform.machine() in ("x86_64", "AMD64"):
        # gcc splits loops into 256-bit vectors on many Intel targets by default.
        return [*BASE_FLAGS, "-mprefer-vector-width=512"]
    return list(BASE_FLAGS)


def default_compiler() -> str:
    """The compiler ``library()`` builds with: ``$CC``, else gcc."""
    return os.environ.get("CC") or "gcc"


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _compiler_version(compiler: str) -> str:
    result = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    )
    return result.stdout.splitlines()[0] if result.stdout else ""


def library_key(compiler: str, flags: list[str]) -> str:
    """What names a cached library: the sources, the flags, the compiler (where it
    resolves and its version: a wrapper of the same gcc that adds flags of its own is
    another compiler) and the CPU."""
    key = hashlib.sha256()
    sources = [path.read_bytes() for path in (*SOURCES, *HEADERS)]
    where = shutil.which(compiler)
    for part in (
        *sources,
        " ".join(flags).encode(),
        str(Path(where).resolve() if where else compiler).encode(),
        _compiler_version(compiler).encode(),
    ):
        key.update(part)
        key.update(b"\0")
    key.update(_cpu_signature().encode())
    return key.hexdigest()[:16]


def build(compiler: str, flags: list[str]) -> Path:
    """Compile ``SOURCES`` into one library with ``flags`` unless one of the same key is
    cached; its path. Raises RuntimeError (with the compiler's message) when the build fails.
    """
    target = _private_build_dir(build_dir()) / f"{LIBRARY}-{library_key(compiler, flags)}.so"
    if os.path.lexists(target):
        reason = untrusted_reason(target)
        if reason is None:
            return target
        log.warning("not loading the cached kernel library: %s; building a fresh one", reason)
        target.unlink()
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", partial, "-lm"],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        # The linker creates its output with the umask's modes; whatever they
        # were, the library must pass untrusted_reason when it is loaded.
        os.chmod(partial, 0o700)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def untrusted_reason(path: Path, *, uid: int | None = None) -> str | None:
    """Why ``path`` (a library or its directory) must not be trusted; None if it may be.

    Trusted: not a symbolic link, owned by ``uid`` (default: this process's
    effective user), and not writable by its group or by others.
    """
    uid = os.geteuid() if uid is None else uid
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link"
    if info.st_uid != uid:
        return f"{path} is owned by uid {info.st_uid}, not by this user (uid {uid})"
    if info.st_mode & _FOREIGN_WRITE:
        mode = stat.S_IMODE(info.st_mode)
        return f"{path} is writable by its group or by others (mode {mode:04o})"
    return None


def _private_build_dir(path: Path) -> Path:
    """``path`` created 0700 (missing parents too) or checked; RuntimeError if not ours."""
    missing = [level for level in (path, *path.parents) if not level.exists()]
    for level in reversed(missing):
        try:
            level.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:
            pass
    info = os.lstat(path)
    if info.st_uid == os.geteuid() and not stat.S_ISLNK(info.st_mode):
        if stat.S_IMODE(info.st_mode) != PRIVATE_DIR_MODE:
            path.chmod(PRIVATE_DIR_MODE)  # files planted meanwhile still fail their own check
    reason = untrusted_reason(path)
    if reason is not None:
        raise RuntimeError(f"refusing to build or load kernels in {path}: {reason}")
    return path


def open_trusted(path: Path) -> tuple[ctypes.CDLL, str]:
    """dlopen ``path`` after checking it and its directory; the library and its sha256.

    Raises RuntimeError, before any of the library's code can run, if either
    fails ``untrusted_reason``.
    """
    path = Path(path)
    reason = untrusted_reason(path.parent) or untrusted_reason(path)
    if reason is not None:
        raise RuntimeError(f"refusing to load the kernel library: {reason}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return ctypes.CDLL(str(path)), digest


def load(path: Path) -> ctypes.CDLL:
    """Load a library ``build`` made (checked as ``open_trusted`` does), signatures declared."""
    lib, _ = open_trusted(path)
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    fn = lib.chatsvc_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ptr, i64, i64,  # query, strides (token, head)
        ptr, ptr, i64, i64, i64,  # k, v, strides (block, slot, head)
        ptr, ptr, i64, i64, i64,  # their scales (int8 caches, else NULL), strides
        ptr, i64, i64,  # out, strides (token, head)
        ptr, i64,  # block_tables, row stride
        ptr, ptr,  # query_start, context_lens
        ptr, i32,  # seqs, num_seqs
        i32, i32, i32, i32,  # num_q_heads, num_kv_heads, head_dim, block_size
        i32, i32,  # q_tile, span (0: slices by load)
        ctypes.c_float, i32, i32, i32,  # scale * log2(e), dtype, KV dtype, num_threads
    ]  # fmt: skip
    lib.chatsvc_attention_uses_tiles.restype = ctypes.c_int
    lib.chatsvc_attention_uses_tiles.argtypes = []
    norm = lib.chatsvc_rms_norm
    norm.restype = None
    norm.argtypes = [
        ptr, i64, ptr, ptr, i64,  # x, row stride, weight, out, row stride
        i64, i64, ctypes.c_float, i32, i32,  # rows, hidden, eps, dtype, num_threads
    ]  # fmt: skip
    write = lib.chatsvc_write_kv
    write.restype = None
    write.argtypes = [
        ptr, i64, i64, ptr, i64, i64,  # key, value and their (token, head) strides
        ptr, ptr, i64, i64, i64,  # k_cache, v_cache, strides (block, slot, head)
        ptr, i64, i64, i64, i64,  # slots, tokens, heads, head_dim, block_size
        i32, i32,  # the rows' dtype, the caches' (the same, or fp32 rows into bf16)
    ]  # fmt: skip
    write = lib.chatsvc_write_kv_int8
    write.restype = None
    write.argtypes = [
        ptr, i64, i64, ptr, i64, i64,  # key, value and their (token, head) strides
        ptr, ptr, i64, i64, i64,  # k_cache, v_cache (int8), strides (block, slot, head)
        ptr, ptr, i64, i64, i64,  # k_scale, v_scale (bf16), strides (block, slot, head)
        ptr, i64, i64, i64, i64, i32,  # slots, tokens, heads, head_dim, block_size, dtype
    ]  # fmt: skip
    rope = lib.chatsvc_rope
    rope.restype = None
    rope.argtypes = [
        ptr, i64, i64, i64, i64, i64,  # x, row and head strides, rows, heads, head_dim
        ptr, ptr, i32, i32,  # cos, sin ([rows, head_dim] each), dtype, num_threads
    ]  # fmt: skip
    swiglu = lib.chatsvc_swiglu
    swiglu.restype = None
    swiglu.argtypes = [
        ptr, i64, ptr, i64,  # gate_up, row stride, out, row stride
        i64, i64, i32, i32,  # rows, intermediate size, dtype, num_threads
    ]  # fmt: skip
    lib.chatsvc_linear_packed_elements.restype = i64
    lib.chatsvc_linear_packed_elements.argtypes = [i64, i64]
    lib.chatsvc_linear_pack.restype = None
    lib.chatsvc_linear_pack.argtypes = [ptr, i64, i64, i64, ptr]  # w, row stride, n, k, packed
    linear = lib.chatsvc_linear
    linear.restype = ctypes.c_int
    linear.argtypes = [
        ptr, i64, i64,  # x, row stride, rows
        ptr, i64, i64,  # packed weight, out features, in features
        ptr, ptr, i64,  # bias, residual, residual row stride (NULL: none)
        ptr, i64, i32,  # out, row stride, num_threads
    ]  # fmt: skip
    lib.chatsvc_linear_uses_tiles.restype = ctypes.c_int
    lib.chatsvc_linear_uses_tiles.argtypes = []
    lib.chatsvc_narrow_linear_packed_elements.restype = i64
    lib.chatsvc_narrow_linear_packed_elements.argtypes = [i64, i64, i32]
    for fmt in ("bf16", "int8", "f32"):
        pack = getattr(lib, f"chatsvc_narrow_linear_pack_{fmt}")
        pack.restype = None
        pack.argtypes = [ptr, i64, i64, i64, ptr]  # w, row stride, n, k, packed
    narrow = lib.chatsvc_narrow_linear
    narrow.restype = ctypes.c_int
    narrow.argtypes = [
        ptr, i64, i64,  # x (fp32), row stride, rows
        ptr, i32, ptr,  # packed weight, format, scale (int8; NULL for bf16)
        i64, i64,  # out features, in features
        ptr, ptr, i64,  # bias, residual, residual row stride (NULL: none)
        ptr, i64, i32, i32,  # out, row stride, wide tiles (0: AVX2 ones), num_threads
    ]  # fmt: skip
    lib.chatsvc_narrow_linear_available.restype = ctypes.c_int
    lib.chatsvc_narrow_linear_available.argtypes = []
    lib.chatsvc_pair_linear_packed_elements.restype = i64
    lib.chatsvc_pair_linear_packed_elements.argtypes = [i64, i64]
    lib.chatsvc_pair_linear_pack.restype = None
    lib.chatsvc_pair_linear_pack.argtypes = [ptr, i64, i64, i64, ptr]  # w, row stride, n, k, out
    pair = lib.chatsvc_pair_linear
    pair.restype = ctypes.c_int
    pair.argtypes = [
        ptr, i64, i64,  # x, row stride, rows
        ptr, i64, i64,  # packed weight, out features, in features
        ptr, ptr, i64,  # bias, residual, residual row stride (NULL: none)
        ptr, i64, i32,  # out, row stride, num_threads
    ]  # fmt: skip
    lib.chatsvc_pair_linear_available.restype = ctypes.c_int
    lib.chatsvc_pair_linear_available.argtypes = []
    lib.chatsvc_decoder_layers.restype = ctypes.c_int
    lib.chatsvc_decoder_layers.argtypes = [ptr]  # a DecoderStep (kernels/cpu/decoder.py)
    lib.chatsvc_decoder_sizes.restype = None
    lib.chatsvc_decoder_sizes.argtypes = [ptr, ptr]  # int64 out: the step's, a layer's


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first call; None when it cannot be built."""
    global _loaded, _loaded_sha256, _error
    if _loaded is not None:  # every kernel call on the CPU asks: no lock once loaded
        return _loaded
    with _lock:
        if _loaded is not None or _error is not None:
            return _loaded
        compiler = default_compiler()
        try:
            if shutil.which(compiler) is None:
                raise RuntimeError(f"no C compiler {compiler!r} on PATH")
            path = build(compiler, default_flags())
            lib, digest = open_trusted(path)
            _declare(lib)
            _loaded, _loaded_sha256 = lib, digest
            log.info("native CPU kernels loaded from %s (sha256 %s)", path, digest)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            _error = str(exc)
            log.warning("native CPU kernels unavailable, using the torch path: %s", _error)
        return _loaded


def require() -> ctypes.CDLL:
    """``library()``, or ValueError saying why it cannot be built."""
    lib = library()
    if lib is None:
        raise ValueError(f"the native CPU kernels are unavailable: {_error}")
    return lib


def library_sha256() -> str | None:
    """The hex sha256 of the library ``library()`` loaded; None if none is loaded."""
    return _loaded_sha256


def unavailable_reason() -> str | None:
    """Why ``library()`` returned None (None when it loaded or was not tried)."""
    return _error
